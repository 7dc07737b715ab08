"""The README's serving examples, run as written there: `python -m torch_xla_ext generate` and the
Engine snippet."""

import os
import re
import shlex
import subprocess
import sys

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def _readme_command():
    """The README's `python -m torch_xla_ext generate ...` line."""
    lines = [line.strip() for line in open(README)
             if line.strip().startswith("python -m torch_xla_ext generate")]
    assert len(lines) == 1, lines
    return shlex.split(lines[0].split("#")[0])


def test_the_readme_command_streams_tokens_and_matches_transformers():
    command = _readme_command()
    result = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True,
                            env=dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU")))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    num_prompts = len(command[command.index("--prompt_lens") + 1].split(","))
    steps = re.findall(r"^step +\d+ \| seqs +(\d+) \| tokens +(\d+) .*\| generated (\d+)/(\d+) \|",
                       out, re.M)
    assert steps, out
    generated = [int(g) for *_, g, _ in steps]
    assert generated == sorted(generated) and generated[-1] > 0  # progress, step by step
    assert "(compiled)" in out
    for i in range(num_prompts):
        assert f"request {i} done: " in out
        assert f"request {i}: equal to transformers' generate" in out
    assert re.search(r"^summary: \d+ requests, \d+ tokens generated in \d+ steps", out, re.M)


def test_text_prompts_need_a_tokenizer():
    result = subprocess.run([sys.executable, "-m", "torch_xla_ext", "generate", "--prompt", "hi"],
                            capture_output=True, text=True, env=dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU")))
    assert result.returncode != 0
    assert "--prompt needs a tokenizer" in result.stderr


def test_a_local_checkpoint(tmp_path):
    """--checkpoint DIR: a transformers checkpoint saved to disk (no tokenizer: token prompts)."""
    from torch_xla_ext.serving import hf

    hf.random_model(dict(hf.TINY, num_hidden_layers=1), seed=5).save_pretrained(tmp_path)
    result = subprocess.run([sys.executable, "-m", "torch_xla_ext", "generate", "--checkpoint",
                             str(tmp_path), "--prompt_lens", "4,9", "--max_new_tokens", "3",
                             "--check"], capture_output=True, text=True,
                            env=dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU")))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"model: checkpoint {tmp_path}: 1 layers" in result.stdout
    assert result.stdout.count("equal to transformers' generate") == 2


def _readme_python(first_line):
    """The README's Python block that starts with `first_line`."""
    blocks = re.findall(r"```python\n(.*?)```", open(README).read(), re.S)
    matches = [b for b in blocks if b.startswith(first_line)]
    assert len(matches) == 1, matches
    return matches[0]


def test_the_readme_engine_example_runs_as_written():
    namespace = {}
    exec(compile(_readme_python("from torch_xla_ext.serving import Engine, hf"), README, "exec"),
         namespace)
    engine, out = namespace["engine"], namespace["out"]
    assert not engine.has_unfinished()
    (tokens,) = out.finished.values()  # the last step finished the one request
    assert len(tokens) == 16
