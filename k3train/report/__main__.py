"""`python -m k3train.report PATH...`: figures and a page of runs and sweeps (k3train/report/cli.py)."""

from k3train.runtime.bootstrap import bootstrap

bootstrap()  # before torch loads (runtime/bootstrap.py)

import sys

from k3train.report.cli import main

sys.exit(main())
