"""`python -m k3train.report.sweep_table SWEEP_DIR`: a sweep's table (k3train/observe/sweep_table.py)."""

import sys

from k3train.observe.sweep_table import main

if __name__ == "__main__":
    sys.exit(main())
