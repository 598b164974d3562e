"""``tokenmill serve`` checks the model, tokenizer, chat templates and memory before it
listens: each failure is one line and exit 1, the traceback only under --log-level debug."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.entrypoints.conftest import REPO_ROOT, free_port
from tokenmill.entrypoints.cli import main

DEMO = Path(__file__).resolve().parents[2] / "src" / "tokenmill" / "model" / "demo_weights"


def _copy(tmp_path: Path, edit: Callable[[Path], None]) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(DEMO, folder)
    edit(folder)
    return folder


def _edit_json(name: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        path = folder / name
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))

    return edit


def _truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    os.truncate(path, path.stat().st_size // 2)


CASES = {
    "no config.json": (lambda f: (f / "config.json").unlink(), "config.json"),
    "truncated weights": (_truncate, "model.safetensors"),
    "mismatched shapes": (
        _edit_json("config.json", lambda c: c.update(intermediate_size=c["intermediate_size"] * 2)),
        "has shape",
    ),
    "garbage tokenizer": (
        lambda f: (f / "tokenizer.json").write_text("{not json"),
        "tokenizer.json",
    ),
    "a chat template that raises": (
        _edit_json(
            "tokenizer_config.json",
            lambda c: c.update(chat_template="{{ raise_exception('boom') }}"),
        ),
        "chat template 'default' fails on a one-message conversation",
    ),
    "a chat template that does not parse": (
        _edit_json("tokenizer_config.json", lambda c: c.update(chat_template="{% if %}")),
        "chat template 'default' fails",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_broken_model_folder_fails_in_one_line_before_listening(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    edit, expected = CASES[case]
    folder = _copy(tmp_path, edit)
    assert main(["serve", str(folder), "--port", str(free_port()), "--num-threads", "1"]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("tokenmill: error: "), err
    assert expected in errors[0], errors
    assert "Traceback" not in err


def test_lora_slots_that_cannot_fit_fail_before_allocating(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--max-lora-rank 1000000 --max-loras 64 tried to allocate ~200 GB: a RuntimeError traceback."""
    argv = ["serve", "demo", "--port", str(free_port()), "--num-threads", "1", "--enable-lora"]
    assert main([*argv, "--max-lora-rank", "1000000", "--max-loras", "64"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tokenmill: error: the flags need"), err
    assert "LoRA slots (--max-loras x --max-lora-rank)" in err[0]


def test_the_server_never_listens_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    folder = _copy(tmp_path, lambda f: (f / "config.json").unlink())
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli"]
    serve = ["serve", str(folder), "--port", str(free_port()), "--num-threads", "1"]
    quiet = subprocess.run(
        [*cmd, *serve], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert quiet.returncode == 1
    assert "Uvicorn running" not in quiet.stderr and "Traceback" not in quiet.stderr
    debug = subprocess.run(
        [*cmd, "--log-level", "debug", *serve],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and "Uvicorn running" not in debug.stderr


_NO_TOOLS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_auto_tool_choice_warns_when_the_template_never_renders_tools(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tokenmill.entrypoints.startup_checks import warn_if_tools_unrendered
    from tokenmill.tokenizer.tokenizer import Tokenizer

    folder = _copy(
        tmp_path,
        _edit_json("tokenizer_config.json", lambda c: c.update(chat_template=_NO_TOOLS_TEMPLATE)),
    )
    tokenizer = Tokenizer.from_pretrained(folder)
    with caplog.at_level("WARNING"):
        message = warn_if_tools_unrendered(tokenizer, None, "hermes")
    assert message is not None and "never renders the request's `tools`" in message
    assert "--chat-template" in message and message in caplog.text
    # The demo model's own template renders them; so does a tool-aware --chat-template.
    assert warn_if_tools_unrendered(Tokenizer.from_pretrained(DEMO), None, "hermes") is None
    demo_template = json.loads((DEMO / "tokenizer_config.json").read_text())["chat_template"]
    assert warn_if_tools_unrendered(tokenizer, demo_template, "hermes") is None


def test_serve_logs_the_tool_template_warning_at_start_up(tmp_path: Path) -> None:
    folder = _copy(
        tmp_path,
        _edit_json("tokenizer_config.json", lambda c: c.update(chat_template=_NO_TOOLS_TEMPLATE)),
    )
    # A missing LoRA adapter stops the start right after the checks: no engine is loaded.
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", str(folder),
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
         "--port", str(free_port()), "--enable-lora", "--lora-modules", f"bad={tmp_path}/none"],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
    )  # fmt: skip
    assert "never renders the request's `tools`" in proc.stderr + proc.stdout
