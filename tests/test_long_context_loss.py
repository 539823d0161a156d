"""``scripts/long_context_loss.py``'s argument checks (its measurement runs in docs/smollm2.md)."""

from __future__ import annotations

import pytest

from tests.conftest import load_script


@pytest.mark.parametrize(("argv", "text"), [
    (["--lengths", "1024,2048"], "each of --lengths must exceed --tail (1024"),
    (["--lengths", "2048", "--tail", "0"], "must exceed --tail (0, >= 1)"),
    (["--lengths", "2k"], "--lengths must be comma-separated integers"),
])
def test_lengths_that_leave_no_tail_are_refused(argv, text, capsys):
    with pytest.raises(SystemExit) as exc:
        load_script("long_context_loss").main(argv)
    assert exc.value.code == 2 and text in capsys.readouterr().err
