"""`python -m k3train.prepare ...`: the dataset preparation CLI (implemented in k3train.data.prepare)."""

from k3train.runtime.bootstrap import bootstrap

bootstrap()  # before torch loads (runtime/bootstrap.py)

from k3train.data.prepare import main

if __name__ == "__main__":
    raise SystemExit(main())
