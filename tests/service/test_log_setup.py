"""Daemon logging: rotating file, optional stderr, a second setup replaces the first."""

from __future__ import annotations

import logging

import pytest

from moed.errors import InvalidRequestError
from moed.service.log_setup import setup_logging


@pytest.fixture
def clean_root():
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    yield root
    for handler in list(root.handlers):
        if handler not in before:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)


def test_log_file_rotates_and_keeps_backup_count(tmp_path, clean_root):
    path = setup_logging(tmp_path / "logs", "INFO", max_bytes=2000, backup_count=2, stderr=False)
    assert path == tmp_path / "logs" / "moed.log"
    log = logging.getLogger("moed.test")
    for i in range(200):
        log.info("line %04d %s", i, "x" * 40)
    files = sorted(p.name for p in path.parent.iterdir())
    assert files == ["moed.log", "moed.log.1", "moed.log.2"]
    assert all((path.parent / f).stat().st_size <= 2000 for f in files)
    assert "line 0199" in path.read_text()  # newest in the live file
    assert "line 0000" not in "".join((path.parent / f).read_text() for f in files)  # oldest rotated away


def test_level_filters_and_second_setup_does_not_duplicate(tmp_path, clean_root):
    path = setup_logging(tmp_path, "warning", stderr=False)
    logging.getLogger("moed.x").info("quiet")
    logging.getLogger("moed.x").warning("loud")
    setup_logging(tmp_path, "INFO", stderr=False)
    logging.getLogger("moed.x").info("once")
    text = path.read_text()
    assert "quiet" not in text and "loud" in text and text.count("once") == 1


def test_stderr_handler_when_asked(tmp_path, clean_root, capsys):
    setup_logging(tmp_path, "INFO", stderr=True)
    logging.getLogger("moed.x").info("to the terminal")
    assert "to the terminal" in capsys.readouterr().err


def test_bad_level_says_which_levels_exist(tmp_path, clean_root):
    with pytest.raises(InvalidRequestError, match="'chatty'.*debug, info"):
        setup_logging(tmp_path, "chatty")
