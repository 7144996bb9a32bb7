"""`edgellm chat` through a pseudo-terminal: two dependent turns, Ctrl-C, commands."""

import os
import re
import signal
import sys
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;]*m")
SPEED = r"\[prompt [^\]]*\]"


def _answer(before: str, question: str) -> str:
    """The answer printed after the echoed question, before the dim speed line."""
    text = ANSI.sub("", before).replace("\r\n", "\n")
    return text.split(question, 1)[1].strip("\n")


@pytest.fixture(params=["sigint-default", "sigint-ignored"])
def chat(request):
    """The chat in a pseudo-terminal; started with SIGINT at its default and, for the Ctrl-C test,
    ignored, as a process launched in the background by a non-interactive shell inherits it."""
    if request.param == "sigint-ignored" and request.function.__name__ != "test_ctrl_c_stops_the_answer_not_the_program":
        pytest.skip("the inherited SIGINT disposition matters for Ctrl-C only")
    ignore = request.param == "sigint-ignored"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = pexpect.spawn(sys.executable, ["-m", "edgellm", "chat", "--backend", "cpu", "--temperature", "0",
                                           "-c", "512", "-n", "64"],
                          env=env, encoding="utf-8", timeout=120, dimensions=(40, 250),
                          preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore else None)
    child.expect("> ")
    yield child
    if child.isalive():
        child.terminate(force=True)


def test_two_turns_second_depends_on_first(chat, default_model):
    q1, q2 = "What is the capital of France?", "And of Germany?"
    chat.sendline(q1)
    chat.expect(SPEED)
    a1 = _answer(chat.before, q1)
    chat.expect("> ")
    chat.sendline(q2)
    chat.expect(SPEED)
    a2 = _answer(chat.before, q2)
    speed2 = chat.after
    chat.expect("> ")
    chat.sendline("/exit")
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0
    # the same answers as the Python API gives for the same conversation, greedy
    m = default_model
    assert "Paris" in a1
    msgs = [{"role": "user", "content": q1}, {"role": "assistant", "content": a1}, {"role": "user", "content": q2}]
    assert a2 == "".join(m.chat(msgs, max_tokens=64, temperature=0))
    assert "Berlin" in a2  # "And of Germany?" means something only after the first turn
    # the second turn prefilled only its new tokens: the first turn's came from the cache
    assert re.search(r"\(\d+ cached\)", speed2)


def test_ctrl_c_stops_the_answer_not_the_program(chat):
    chat.sendline("/system You are a storyteller who writes very long stories.")
    chat.expect("system message set")
    chat.expect("> ")
    chat.sendline("Tell me a long story about a dragon.")
    chat.expect("dragon.\r\n")
    chat.expect(r"\w\w")  # the answer has started
    chat.sendintr()
    chat.expect(SPEED)
    assert "Ctrl-C" in chat.after
    chat.expect("> ")
    chat.sendline("/reset")
    chat.expect("conversation forgotten")
    chat.expect("> ")
    chat.sendline("/exit")
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0
