"""`python -m inference lm`: streams text from a trained run, serves several prompts, and
answers bad input with one line and exit status 2."""

import pytest

from meshwork.inference.cli import main
from meshwork.inference.generate import Generator
from meshwork.inference.runs import load_run
from meshwork.inference.sampling import SamplingParams
from meshwork.data.text import ByteTokenizer


@pytest.fixture(scope="module")
def run_dir(lm_tiny_runs):
    return str(lm_tiny_runs["1dev"]["run_dir"])


def greedy_text(run_dir, prompt: str, n: int) -> str:
    model = load_run(run_dir)[1]
    tok = ByteTokenizer()
    ids = Generator(model).generate([list(tok.encode(prompt))], SamplingParams(temperature=0.0, max_new_tokens=n))
    return tok.decode(ids[0])


def test_lm_streams_a_greedy_continuation(run_dir, capsys):
    assert main(["lm", "--checkpoint", run_dir, "--prompt", "def __init__(self", "--temperature", "0",
                 "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert out == "def __init__(self" + greedy_text(run_dir, "def __init__(self", 24) + "\n"


def test_lm_serves_a_prompts_file(run_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import \nclass \n\nreturn self.\n")
    assert main(["lm", "--checkpoint", run_dir, "--prompts-file", str(prompts), "--temperature", "0",
                 "--max-new-tokens", "12", "--slots", "2"]) == 0
    out = capsys.readouterr().out
    # Each prompt's result is what it gives alone (greedy), in prompt order.
    expected = [f"[{i}] {p}{greedy_text(run_dir, p, 12)}\n" for i, p in enumerate(["import ", "class ", "return self."])]
    assert out == "".join(expected)


@pytest.mark.parametrize("argv, message", [
    (["lm", "--checkpoint", "/nonexistent/run", "--prompt", "x"], "has no config.yaml"),
    (["lm", "--checkpoint", "RUN", "--prompt", ""], "empty prompt"),
    (["lm", "--checkpoint", "RUN", "--prompt-ids", "1,2,999"], "outside the model's vocabulary"),
    (["lm", "--checkpoint", "RUN", "--prompt", "x", "--top-p", "0"], "top_p"),
    (["lm", "--checkpoint", "RUN", "--prompt", "x" * 40, "--max-len", "32"], "exceeds the cache"),
    (["lm", "--hf", "/nonexistent/dir", "--prompt", "x"], "not a directory"),
    (["lm", "--checkpoint", "RUN"], "no prompt"),
])
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
    assert main(["lm", "--hf", str(out), "--prompt-ids", ",".join(map(str, prompt)), "--temperature", "0",
                 "--max-new-tokens", "16"]) == 0
    ids = [int(t) for t in capsys.readouterr().out.split()]
    assert ByteTokenizer().decode(ids) == "for i in range(" + greedy_text(run_dir, "for i in range(", 16)
    # Exporting again over it is refused, and nothing is touched.
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert main(["export-hf", "--checkpoint", run_dir, "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err and (out / "model.safetensors").stat().st_mtime_ns == before
