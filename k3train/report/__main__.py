import sys

from k3train.report.cli import main

sys.exit(main())
