"""`make align` on one machine: the local launcher (local.py) and the simulated users (users.py)."""
