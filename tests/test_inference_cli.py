"""`python -m inference lm`: streams text from a trained run, serves several prompts (each with
its own seed; ids printed as `PROMPT | NEW`), names its defaults in --help, and answers bad input
with one line and exit status 2."""

import re

import pytest

from meshwork.data.text import ByteTokenizer
from meshwork.engine.generate import Generator
from meshwork.engine.sampling import SamplingParams
from meshwork.inference.cli import main, parse_args
from meshwork.inference.lm import per_request_seeds
from meshwork.inference.runs import load_run


@pytest.fixture(scope="module")
def run_dir(lm_tiny_runs):
    return str(lm_tiny_runs["1dev"]["run_dir"])


def greedy_text(run_dir, prompt: str, n: int) -> str:
    model = load_run(run_dir)[1]
    tok = ByteTokenizer()
    ids = Generator(model).generate([list(tok.encode(prompt))], SamplingParams(temperature=0.0, max_new_tokens=n))
    return tok.decode(ids[0])


def test_lm_streams_a_greedy_continuation(run_dir, capsys):
    assert (
        main(
            [
                "lm",
                "--checkpoint",
                run_dir,
                "--prompt",
                "def __init__(self",
                "--temperature",
                "0",
                "--max-new-tokens",
                "24",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out == "def __init__(self" + greedy_text(run_dir, "def __init__(self", 24) + "\n"


def test_lm_serves_a_prompts_file(run_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import \nclass \n\nreturn self.\n")
    assert (
        main(
            [
                "lm",
                "--checkpoint",
                run_dir,
                "--prompts-file",
                str(prompts),
                "--temperature",
                "0",
                "--max-new-tokens",
                "12",
                "--slots",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    # Each prompt's result is what it gives alone (greedy), in prompt order.
    expected = [
        f"[{i}] {p}{greedy_text(run_dir, p, 12)}\n" for i, p in enumerate(["import ", "class ", "return self."])
    ]
    assert out == "".join(expected)


@pytest.mark.parametrize(
    "command, defaults",
    [
        (
            "lm",
            [
                "--max-new-tokens MAX_NEW_TOKENS\n",
                "(default: 64)",
                "0 for greedy decoding (default: 1.0)",
                "(default: 1.0)",
                "prompt i of a batch uses seed + i",
                "(default: 8)",
                "(default: none)",
            ],
        ),
        (
            "diffusion",
            [
                "4 per class, so 40 for the 10 digits",
                "sampler steps (default: 50)",
                "(default: ddim)",
                "(default: grid.png)",
                "one row per class",
            ],
        ),
    ],
)
def test_help_names_the_defaults(command, defaults, capsys):
    with pytest.raises(SystemExit):
        parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal's width
    for default in defaults:
        assert " ".join(default.split()) in text, (default, text)
    assert "(default: None)" not in text and "(default: [])" not in text and "(default: False)" not in text


def served(out: str) -> list[str]:
    """The texts of `[i] TEXT` results, in order (a sampled text may hold newlines)."""
    parts = re.split(r"^\[(\d+)\] ", out, flags=re.M)
    assert parts[0] == "" and parts[1::2] == [str(i) for i in range(len(parts) // 2)], out
    return parts[2::2]


def test_equal_prompts_in_a_batch_get_their_own_seeds(run_dir, capsys):
    params = SamplingParams(temperature=0.8, seed=3)
    assert [p.seed for p in per_request_seeds(params, 3)] == [3, 4, 5]  # prompt i: seed + i
    assert (
        main(
            [
                "lm",
                "--checkpoint",
                run_dir,
                "--prompt",
                "def ",
                "--prompt",
                "def ",
                "--max-new-tokens",
                "16",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    first, second = served(capsys.readouterr().out)
    assert first.startswith("def ") and second.startswith("def ") and first != second


@pytest.mark.parametrize(
    "argv, message",
    [
        (["lm", "--checkpoint", "/nonexistent/run", "--prompt", "x"], "has no config.yaml"),
        (["lm", "--checkpoint", "RUN", "--prompt", ""], "empty prompt"),
        (["lm", "--checkpoint", "RUN", "--prompt-ids", "1,2,999"], "outside the model's vocabulary"),
        (["lm", "--checkpoint", "RUN", "--prompt", "x", "--top-p", "0"], "top_p"),
        (["lm", "--checkpoint", "RUN", "--prompt", "x" * 40, "--max-len", "32"], "exceeds the cache"),
        (["lm", "--hf", "/nonexistent/dir", "--prompt", "x"], "not a directory"),
        (["lm", "--checkpoint", "RUN"], "no prompt"),
    ],
)
def test_bad_input_is_one_line_and_status_2(run_dir, capsys, argv, message):
    argv = [run_dir if a == "RUN" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_export_hf_round_trip_generates_the_same_text(run_dir, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export-hf", "--checkpoint", run_dir, "--out", str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    capsys.readouterr()
    prompt = list(ByteTokenizer().encode("for i in range("))
    assert (
        main(
            [
                "lm",
                "--hf",
                str(out),
                "--prompt-ids",
                ",".join(map(str, prompt)),
                "--temperature",
                "0",
                "--max-new-tokens",
                "16",
            ]
        )
        == 0
    )
    ids = [int(t) for t in capsys.readouterr().out.split()]
    assert ids[: len(prompt)] == prompt
    assert ByteTokenizer().decode(ids) == "for i in range(" + greedy_text(run_dir, "for i in range(", 16)
    # No tokenizer.json here: with several prompts, each line is `[i] PROMPT IDS | NEW IDS`.
    ids_arg = ",".join(map(str, prompt))
    assert (
        main(
            [
                "lm",
                "--hf",
                str(out),
                "--prompt-ids",
                ids_arg,
                "--prompt-ids",
                ids_arg,
                "--temperature",
                "0",
                "--max-new-tokens",
                "8",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"[{i}] {' '.join(map(str, prompt))} | {' '.join(map(str, ids[len(prompt) :][:8]))}" for i in range(2)
    ]
    # Exporting again over it is refused, and nothing is touched.
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert main(["export-hf", "--checkpoint", run_dir, "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err and (out / "model.safetensors").stat().st_mtime_ns == before
