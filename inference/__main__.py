"""python3 -m meshwork.inference {lm,diffusion,export} ... (python3 -m inference in a checkout)."""

from meshwork.inference.cli import run

if __name__ == "__main__":
    run()
