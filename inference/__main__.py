"""python3 -m meshwork.inference {diffusion,lm,export-hf,export-peft,serve} ... (python3 -m inference in a checkout)."""

from meshwork.inference.cli import run

if __name__ == "__main__":
    run()
