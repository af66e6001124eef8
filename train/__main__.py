"""python3 -m meshwork.train --config FILE [--dry-run] [section.key=value ...] (python3 -m train in a checkout)."""
from meshwork.train.cli import run

if __name__ == "__main__":
    run()
