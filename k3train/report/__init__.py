"""Reading finished, running and crashed runs back: `python -m k3train.report PATH...` draws figures and one HTML
page (cli.py); sweep_table.py builds a sweep's table. matplotlib is needed only to draw (figures.py)."""
