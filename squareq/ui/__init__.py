"""``squareq ui``: a local page that watches and steers training runs. It reads what the trainer writes into each run
folder (paths.py: the folders it may touch; runs.py: reading them), starts and stops ``squareq train`` processes
through a queue kept as a file (queue.py, start.py), and serves the page (app.py, static/)."""
