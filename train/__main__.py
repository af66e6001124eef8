"""python3 -m meshwork.train --config FILE [--dry-run] [section.key=value ...] (python3 -m train in a checkout)."""


def main() -> None:
    from meshwork.train import interrupts

    interrupts.hold_until_the_guard()  # before the imports below (jax, pydantic) take their seconds
    from meshwork.train.cli import run

    run()


if __name__ == "__main__":
    main()
