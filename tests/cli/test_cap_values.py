"""`moed cap VALUE` (and `moed serve --vram-cap`): a bad value is one line and exit 2, never a traceback.

The value is parsed before any call to the daemon, so these run without one: the socket points nowhere,
and a value that got past the parser would say "no moed daemon is answering" instead.
"""

from __future__ import annotations

import pytest

from moed.cli.client_cmds import MAX_CAP_BYTES, parse_cap
from moed.cli.main import main
from moed.errors import InvalidRequestError

BAD = ["1e30", "99999999999999999999999G", "1e300T", "inf", "-inf", "infG", "nan", "nanG", "-5", "-1G", "0.4",
       "", " ", "G", "%", "-5%", "150%", "100.01%", "0%", "nan%", "inf%", "1e400%", "abc", "6GG", "0x10",
       "1e999999999G", "1e99999999999999", "1e-99999999999%", "1e-999999999G", "0G",
       str(MAX_CAP_BYTES + 1), "2000000000000000000"]


@pytest.mark.parametrize("value", BAD)
def test_bad_cap_is_one_line_and_exit_2(tmp_path, capsys, value):
    code = main(["cap", "--socket", str(tmp_path / "nobody.sock"), "--", value])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in err and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moed: error: cap "), err
    assert "no moed daemon" not in err  # rejected before any call


@pytest.mark.parametrize("value, want", [
    ("auto", (0, None)), ("0", (0, None)), ("off", (0, None)), ("6G", (6_000_000_000, None)),
    ("6000m", (6_000_000_000, None)), ("1.5g", (1_500_000_000, None)), ("4096", (4096, None)),
    ("50%", (0, 0.5)), ("100%", (0, 1.0)), ("0.5%", (0, 0.005)), (" 2T ", (2_000_000_000_000, None)),
    (str(MAX_CAP_BYTES), (MAX_CAP_BYTES, None)),
])
def test_good_caps_still_parse(value, want):
    assert parse_cap(value) == want


def test_limit_fits_a_uint64():
    assert 0 < MAX_CAP_BYTES < 2**64
    with pytest.raises(InvalidRequestError, match="at most"):
        parse_cap("1e30")
