"""The evaluation harness (`coordrl eval`): sweeps, baselines, metrics, resumable traces and reports."""
