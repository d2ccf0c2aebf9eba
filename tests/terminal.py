"""Starting a command as from a terminal, where Ctrl-C (SIGINT) reaches it.

A suite started in the background of a non-interactive shell passes SIGINT on ignored, and Python keeps an
ignored SIGINT ignored: a command under test would then never see the test's Ctrl-C. Give
``preexec_fn=sigint_as_in_a_terminal`` to ``subprocess.Popen``.
"""

from __future__ import annotations

import signal


def sigint_as_in_a_terminal() -> None:
    """Restore SIGINT's default in the child, before it runs the command."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
