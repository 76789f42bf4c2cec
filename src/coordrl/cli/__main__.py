import sys

from coordrl.cli.main import main

sys.exit(main())
