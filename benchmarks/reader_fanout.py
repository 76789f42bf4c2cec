"""Fan-out benchmark: one broadcast of 2 queries to every chunk of an 896K-token document.

Against a loopback OpenAI-compatible server with injected latency L (FaultInjectingFakeServer from
tests/, run as a separate process so it does not share the client's CPU or event loop), prints the
wall time of one broadcast next to the bound ``1.2 * ceil(calls / concurrency) * L``, for 512-token
chunks (1,750 readers) and 4,096-token chunks (219 readers), then the client overhead per call at
L = 0 (target <= 0.3 ms): client process CPU time per call, and wall time per call.

Chunk text is synthetic (about 4 characters per token), so no tokenizer is needed.

    .venv/bin/python benchmarks/reader_fanout.py [--concurrency 64 256] [--latencies 0.05 0.2]

Concurrency 64 is the fleet's default (``OpenAIReaderFleet(max_concurrency=64)``); 256 is a stress
point. The bound allows 20% of L per wave for everything that is not latency, while the client's own
work per wave grows with the wave: at 256 requests of 16 KB (4,096-token chunks) it is about
256 x 0.16-0.23 ms of CPU = 41-59 ms against 10 ms at L = 0.05 s, so that stress point is over the
bound on 2 cores (docs/benchmarks.md weighs it against a GPU run).

Then one GPU-run-scale round per HTTP client stack, all in this run so their ratios are fair:
16 rollouts x 2 queries x 219 chunks of 4,096 tokens = 7,008 requests of about 16 KB. ``httpx``
(``httpx.AsyncClient``, its default transport) and ``aiohttp`` (``aiohttp.ClientSession``) send the
fleet's own encoded bodies, each behind the fleet's concurrency limit with a per-attempt deadline
and the reply's JSON parsed; ``fleet`` is ``OpenAIReaderFleet.answer`` itself (aiohttp, plus body
encoding, retries and the reader's reply handling). Per stack, concurrency and latency it prints the
client's CPU per request (process time; the server runs in another process) and the wall time of
the round; repeats are interleaved across stacks (ABC ABC ...) so that a busy moment of the machine
hits every stack.

    .venv/bin/python benchmarks/reader_fanout.py --skip-broadcast --stacks httpx aiohttp fleet \
        --round-concurrency 64 256 --round-latencies 0 0.05 0.2 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import aiohttp
import httpx

from coordrl.readers.base import ReaderRequest
from coordrl.readers.chat_client import _Slots
from coordrl.readers.openai_fleet import OpenAIReaderFleet

DOC_TOKENS = 896_000
CHARS_PER_TOKEN = 4
QUERIES = ("Who founded the company mentioned in this passage?", "In which year did the event take place?")
_WORDS = [
    "the",
    "of",
    "river",
    "city",
    "founded",
    "year",
    "company",
    "film",
    "born",
    "director",
    "album",
    "war",
    "king",
    "state",
    "music",
    "team",
]


def synthetic_chunks(chunk_tokens: int, seed: int = 0) -> list[str]:
    """ceil(DOC_TOKENS / chunk_tokens) chunks of about chunk_tokens * 4 characters each."""
    rng = random.Random(seed)
    n = math.ceil(DOC_TOKENS / chunk_tokens)
    size = chunk_tokens * CHARS_PER_TOKEN
    chunks = []
    for i in range(n):
        words = []
        length = 0
        while length < size:
            word = rng.choice(_WORDS)
            words.append(word)
            length += len(word) + 1
        chunks.append(f"Document {i + 1}:\nTitle {i}\n" + " ".join(words)[:size])
    return chunks


class FakeServerProcess:
    """FaultInjectingFakeServer in a child process, for one latency."""

    def __init__(self, latency_s: float):
        script = REPO / "tests" / "fault_injecting_server.py"
        self.proc = subprocess.Popen(
            [sys.executable, str(script), "--latency", str(latency_s)], stdout=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"fake server did not start: {line!r}")
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"

    def __enter__(self) -> FakeServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def make_fleet(url: str, concurrency: int) -> OpenAIReaderFleet:
    return OpenAIReaderFleet([url], "fake-reader", max_concurrency=concurrency, api_key_env=None, timeout_s=120)


async def broadcast(fleet: OpenAIReaderFleet, chunks: list[str], tag: str) -> tuple[float, int]:
    requests = [ReaderRequest(q, c, f"{tag}/{i}") for q in QUERIES for i, c in enumerate(chunks)]
    start = time.perf_counter()
    results = await fleet.answer(requests)
    wall = time.perf_counter() - start
    failed = sum(not r.ok for r in results)
    if failed:
        print(f"  WARNING: {failed} failed calls, e.g. {next(r.error for r in results if not r.ok)}")
    return wall, len(requests)


async def run_latency(url: str, latency_s: float, concurrency: int, chunk_sets: dict[int, list[str]]) -> None:
    fleet = make_fleet(url, concurrency)
    try:
        for chunk_tokens, chunks in chunk_sets.items():
            await broadcast(fleet, chunks[:concurrency], "warmup")  # open the pool's connections
            wall, calls = await broadcast(fleet, chunks, f"c{chunk_tokens}")
            bound = 1.2 * math.ceil(calls / concurrency) * latency_s
            verdict = "OK" if wall <= bound else "OVER"
            print(
                f"  L={latency_s:.2f}s chunk={chunk_tokens:>4} tokens readers={len(chunks):>4} calls={calls:>4}: "
                f"wall {wall:.3f}s vs bound {bound:.3f}s  [{verdict}]  ({wall / bound:.2f} x bound)"
            )
    finally:
        await fleet.aclose()


async def run_overhead(url: str, concurrency: int, chunks: list[str], rounds: int) -> None:
    fleet = make_fleet(url, concurrency)
    try:
        await broadcast(fleet, chunks[:concurrency], "warmup")
        cpu0, wall0 = time.process_time(), time.perf_counter()
        calls = 0
        for r in range(rounds):
            _, n = await broadcast(fleet, chunks, f"ovh{r}")
            calls += n
        cpu = time.process_time() - cpu0
        wall = time.perf_counter() - wall0
    finally:
        await fleet.aclose()
    per_call_cpu_ms = cpu / calls * 1e3
    verdict = "OK" if per_call_cpu_ms <= 0.3 else "OVER"
    print(
        f"  L=0 calls={calls} ({len(chunks[0]) // CHARS_PER_TOKEN}-token chunks): client CPU {per_call_cpu_ms:.3f} ms/call "
        f"[{verdict} vs 0.3 ms]; wall {wall / calls * 1e3:.3f} ms/call (client + loopback server, {os.cpu_count()} CPUs)"
    )


# -- client stacks at GPU-run scale ------------------------------------------------------------------

ROUND_TIMEOUT_S = 120.0  # per-attempt deadline, as reader_timeout_s in the 8xH100 configs


class HttpxClient:
    """httpx.AsyncClient.post on its default transport (httpcore), the pool sized to the concurrency;
    deadline by asyncio.timeout (httpx's own timeouts are per read/write)."""

    def __init__(self, url: str, concurrency: int) -> None:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.client = httpx.AsyncClient(
            limits=limits,
            timeout=httpx.Timeout(ROUND_TIMEOUT_S),
            headers={"Content-Type": "application/json"},
        )
        self.endpoint = httpx.URL(url + "/v1/chat/completions")

    async def post(self, body: bytes) -> tuple[int, bytes]:
        async with asyncio.timeout(ROUND_TIMEOUT_S):
            response = await self.client.post(self.endpoint, content=body)
        return response.status_code, response.content

    async def aclose(self) -> None:
        await self.client.aclose()


class AiohttpSession:
    """aiohttp.ClientSession.post on a TCPConnector sized to the concurrency, total deadline by ClientTimeout."""

    def __init__(self, url: str, concurrency: int) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency),
            timeout=aiohttp.ClientTimeout(total=ROUND_TIMEOUT_S),
            headers={"Content-Type": "application/json"},
        )
        self.endpoint = url + "/v1/chat/completions"

    async def post(self, body: bytes) -> tuple[int, bytes]:
        async with self.session.post(self.endpoint, data=body) as response:
            return response.status, await response.read()

    async def aclose(self) -> None:
        await self.session.close()


STACKS = {"httpx": HttpxClient, "aiohttp": AiohttpSession, "fleet": None}


def round_requests(rollouts: int, queries: int, chunk_tokens: int) -> list[ReaderRequest]:
    """One round's reader requests: rollouts x queries x chunks (the rollouts of a GRPO group read one document)."""
    chunks = synthetic_chunks(chunk_tokens)
    qs = (QUERIES * queries)[:queries]
    return [ReaderRequest(q, c, f"c{i}") for q in qs for i, c in enumerate(chunks)] * rollouts


async def fleet_round(url: str, concurrency: int, requests: list[ReaderRequest]) -> tuple[float, float]:
    """(wall s, client CPU s) of ``OpenAIReaderFleet.answer`` over one round, after a warm-up wave."""
    fleet = make_fleet(url, concurrency)
    try:
        await fleet.answer(requests[:concurrency])
        cpu0, wall0 = time.process_time(), time.perf_counter()
        results = await fleet.answer(requests)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        await fleet.aclose()
    failed = sum(not r.ok for r in results)
    if failed:
        print(f"  WARNING: fleet: {failed} failed requests")
    return wall, cpu


async def run_round(stack: str, url: str, concurrency: int, requests: list[ReaderRequest]) -> tuple[float, float]:
    """(wall s, client CPU s) of one round after a warm-up wave that opens the pool's connections."""
    if stack == "fleet":
        return await fleet_round(url, concurrency, requests)
    encoder = make_fleet(url, concurrency)
    bodies = [encoder.encode_body(r) for r in requests]  # not timed: every stack sends these bytes
    client = STACKS[stack](url, concurrency)
    slots = _Slots(concurrency)
    failed = 0

    async def one(body: bytes) -> None:
        nonlocal failed
        async with slots:
            status, content = await client.post(body)
        if status != 200 or not json.loads(content)["choices"][0]["message"]["content"]:
            failed += 1

    async def wave(batch: list[bytes]) -> None:
        loop = asyncio.get_running_loop()
        tasks = []
        for i, body in enumerate(batch, 1):
            tasks.append(loop.create_task(one(body)))
            if i % 32 == 0:  # as OpenAIReaderFleet.answer starts a large batch
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)

    try:
        await wave(bodies[:concurrency])
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await wave(bodies)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        await client.aclose()
    if failed:
        print(f"  WARNING: {stack}: {failed} failed requests")
    return wall, cpu


def compare_stacks(args: argparse.Namespace) -> None:
    stacks = args.stacks
    print(
        f"client stacks, one round = {args.round_rollouts} rollouts x {args.round_queries} queries x "
        f"{math.ceil(DOC_TOKENS / args.round_chunk_tokens)} chunks of {args.round_chunk_tokens} tokens; "
        f"{args.repeats} interleaved repeats; min / median"
    )
    for latency in args.round_latencies:
        with FakeServerProcess(latency) as server:
            requests = round_requests(args.round_rollouts, args.round_queries, args.round_chunk_tokens)
            n = len(requests)
            encoder = make_fleet(server.url, 1)
            kb = sum(len(encoder.encode_body(r)) for r in requests) / n / 1024
            for concurrency in args.round_concurrency:
                runs: dict[str, list[tuple[float, float]]] = {s: [] for s in stacks}
                for _ in range(args.repeats):
                    for stack in stacks:
                        runs[stack].append(asyncio.run(run_round(stack, server.url, concurrency, requests)))
                bound = math.ceil(n / concurrency) * latency
                print(
                    f"  L={latency:.2f}s concurrency {concurrency}: {n} requests of {kb:.1f} KB"
                    + (f", latency floor {bound:.2f}s" if latency else "")
                )
                for stack in stacks:
                    walls = sorted(w for w, _ in runs[stack])
                    cpus = sorted(c / n * 1e3 for _, c in runs[stack])
                    med = len(walls) // 2
                    print(
                        f"    {stack:<12} client CPU {cpus[0]:.3f} / {cpus[med]:.3f} ms/request   "
                        f"wall {walls[0]:.2f} / {walls[med]:.2f} s/round"
                    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[64, 256],
        help="fleet max_concurrency values (default: 64, the fleet default, and 256)",
    )
    parser.add_argument("--latencies", type=float, nargs="+", default=[0.05, 0.2])
    parser.add_argument("--overhead-rounds", type=int, default=3, help="broadcasts at L=0 (default 3)")
    parser.add_argument("--skip-broadcast", action="store_true", help="only the client-stack comparison")
    parser.add_argument("--stacks", nargs="*", choices=sorted(STACKS), default=list(STACKS))
    parser.add_argument("--round-concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--round-latencies", type=float, nargs="+", default=[0.0, 0.05, 0.2])
    parser.add_argument("--round-rollouts", type=int, default=16)
    parser.add_argument("--round-queries", type=int, default=2)
    parser.add_argument("--round-chunk-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per stack (default 3)")
    args = parser.parse_args()
    if args.skip_broadcast:
        if args.stacks:
            compare_stacks(args)
        return

    chunk_sets = {512: synthetic_chunks(512), 4096: synthetic_chunks(4096)}
    print(f"document {DOC_TOKENS} tokens; 2 queries per reader; {os.cpu_count()} CPUs")
    for concurrency in args.concurrency:
        print(f"concurrency {concurrency}:")
        for latency in args.latencies:
            with FakeServerProcess(latency) as server:
                asyncio.run(run_latency(server.url, latency, concurrency, chunk_sets))
    print(f"client overhead (concurrency {args.concurrency[0]}):")
    with FakeServerProcess(0.0) as server:
        for _chunk_tokens, chunks in chunk_sets.items():
            asyncio.run(run_overhead(server.url, args.concurrency[0], chunks, args.overhead_rounds))
    if args.stacks:
        compare_stacks(args)


if __name__ == "__main__":
    main()
