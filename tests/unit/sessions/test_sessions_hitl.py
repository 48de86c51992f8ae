"""HITL prompt detection on the last line of output, after ANSI stripping."""

from __future__ import annotations

import pytest

from agentic_sandbox.broker.sessions.hitl import detect_prompt, last_line, strip_ansi


@pytest.mark.parametrize(
    "tail",
    [
        b"Do you want to continue? [Y/n] ",
        b"Overwrite file.txt? (y/n) ",
        b"Proceed (yes/no)? ",
        b"\x1b[1;33mAre you sure you want to delete it?\x1b[0m ",
        b"Press ENTER to continue",
        b"[sudo] password for agent: ",
        b"Password: ",
        b"Enter passphrase for key '/root/.ssh/id_ed25519': ",
        b"some output\r\nmore output\r\nReally replace? ",
        b"progress 10%\rprogress 100%\rContinue? [y/N] ",
        b"Type 'yes' to confirm: ",
    ],
)
def test_prompts_are_detected(tail: bytes) -> None:
    assert detect_prompt(tail) is not None


@pytest.mark.parametrize(
    "tail",
    [
        b"Do you want to continue? [Y/n] y\r\n",  # answered: output moved on
        b"are you sure? no.\n",
        b"compiling...\r\n",
        b"",
        b"PROMPT> ",
        b"the password field was updated\r\n$ ",
    ],
)
def test_non_prompts_are_not(tail: bytes) -> None:
    assert detect_prompt(tail) is None


def test_strip_ansi_and_last_line() -> None:
    assert strip_ansi(b"\x1b[31mred\x1b[0m \x1b]0;title\x07x\x07") == "red x"
    assert last_line(b"a\r\nb\r\n\x1b[Kc") == "c"
    assert last_line(b"a\r\n") == ""
    assert len(last_line(b"q" * 1000)) == 300
