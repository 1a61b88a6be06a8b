"""Reading finished, running and crashed runs back: the sweep table (sweep_table.py)."""
