"""What each rank prints (config.console): rank 0 every line we log; another rank only its errors and the warnings about
its own state, tagged with its rank; nothing tagged in a single process."""

import io
import logging
import os
import sys
import warnings

import pytest

from config import console


def printed(rank: int, world_size: int, log_lines) -> str:
    """What a console handler with `rank`'s filter prints when `log_lines(logger)` logs."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(console.RankFilter(rank, world_size))
    logger = logging.getLogger(f"trainer.test_console.{rank}.{world_size}")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        log_lines(logger)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def some_lines(logger: logging.Logger) -> None:
    """A progress line, a run-wide warning, a warning about this rank's own state, an error."""
    logger.info("step %d: loss=%.1f", 1, 2.0)
    logger.warning("no held-out split in %s", "rows.jsonl")
    logger.warning("a prompt of %d tokens was skipped", 90, extra=console.ABOUT_THIS_RANK)
    logger.error("the reward function failed")


def test_rank_zero_prints_every_line_and_tags_only_its_own_warnings_and_errors():
    assert printed(0, 8, some_lines).splitlines() == [
        "step 1: loss=2.0", "no held-out split in rows.jsonl", "rank 0: a prompt of 90 tokens was skipped",
        "rank 0: the reward function failed"]


def test_another_rank_prints_only_its_own_warnings_and_errors_tagged():
    assert printed(5, 8, some_lines).splitlines() == [
        "rank 5: a prompt of 90 tokens was skipped", "rank 5: the reward function failed"]


def test_a_single_process_prints_every_line_untagged():
    assert printed(0, 1, some_lines).splitlines() == [
        "step 1: loss=2.0", "no held-out split in rows.jsonl", "a prompt of 90 tokens was skipped",
        "the reward function failed"]


def test_a_tagged_record_is_a_copy_other_handlers_see_as_logged():
    """The tag is the console's: a handler beside it (a test's capture, a log file) keeps the message as logged."""
    seen = []
    beside = logging.Handler()
    beside.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("trainer.test_console.beside")
    logger.addHandler(beside)
    try:
        output = printed(3, 4, lambda tagged: (tagged.addHandler(beside), tagged.error("disk full")))
    finally:
        logger.removeHandler(beside)
    assert output == "rank 3: disk full\n" and seen == ["disk full"]


@pytest.fixture
def restored_logging(monkeypatch):
    """Undo what `console.setup` changes in this process: the root and torch handlers' filters, the levels, the
    warnings filters and capture, the excepthook and $TRANSFORMERS_VERBOSITY."""
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    handlers = [*logging.getLogger().handlers, *logging.getLogger("torch").handlers]
    filters = {handler: list(handler.filters) for handler in handlers}
    levels = {name: logging.getLogger(name).level for name in (*console.OUR_PACKAGES, *console.QUIET_LIBRARIES)}
    with warnings.catch_warnings():
        yield
    logging.captureWarnings(False)
    for handler, kept in filters.items():
        handler.filters[:] = kept
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_setup_filters_the_console_once_however_often_it_runs(restored_logging):
    """GRPO's default start runs the SFT loop's `main` inside its own: the second set-up replaces the first's filter."""
    console.setup(rank=2, world_size=4)
    console.setup(rank=2, world_size=4)
    for handler in (*logging.getLogger().handlers, *logging.getLogger("torch").handlers):
        assert sum(isinstance(each, console.RankFilter) for each in handler.filters) == 1
    assert logging.getLogger("trainer").level == logging.WARNING  # rank 2's own warnings reach the filter
    assert logging.getLogger("transformers").level == logging.ERROR
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "error"  # transformers' own set-up, later, keeps errors only


def test_the_libraries_progress_bars_are_silent_in_a_log_file_only(restored_logging, monkeypatch):
    """Megatron-Bridge's weight-loading bar (rich's console) prints once into a log file, cut to 80 columns ("Loading
    from /root/.cache/megatron-trai… … (30/… Qwen2Br…"): off there, kept on a terminal."""
    import rich

    monkeypatch.setattr(rich.get_console(), "quiet", False)
    for terminal in (True, False):
        monkeypatch.setattr(sys.stdout, "isatty", lambda: terminal, raising=False)
        console.setup(rank=0, world_size=1)
        assert rich.get_console().quiet is not terminal


def test_an_uncaught_exception_names_its_rank_before_the_traceback(restored_logging, capsys):
    console.setup(rank=6, world_size=8)
    try:
        raise ValueError("boom")
    except ValueError:
        sys.excepthook(*sys.exc_info())
    stderr = capsys.readouterr().err
    assert stderr.startswith("rank 6: ValueError (its traceback follows)\n") and "ValueError: boom" in stderr


def test_the_users_own_codes_warnings_print_on_every_rank_that_meets_them(tmp_path, monkeypatch):
    """A reward, tool or environment module the config names (`config.user_code.load`): its logged warnings and its
    Python warnings print on a rank other than 0 too, tagged (they are about that rank's episodes); its info lines do
    not, and a warning from a module it did not name stays rank 0's."""
    from config import user_code

    (tmp_path / "my_reward.py").write_text(
        "import logging, warnings\n"
        "log = logging.getLogger('my_reward')\n"
        "def reward(completion, reference):\n"
        "    log.info('scoring')\n"
        "    log.warning('a reference without a number')\n"
        "    warnings.warn('a slow path')\n"
        "    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(console, "USER_FILES", set())
    reward = user_code.load("my_reward:reward", "grpo.reward", "")
    assert console.USER_FILES == {str(tmp_path / "my_reward.py")}
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(console.RankFilter(3, 4))
    root = logging.getLogger()
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            logging.captureWarnings(True)
            reward("1", "2")
            logging.getLogger("someone_else").warning("not the user's")
    finally:
        logging.captureWarnings(False)
        root.removeHandler(handler)
        root.setLevel(level)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "rank 3: a reference without a number"
    assert lines[1].startswith(f"rank 3: {tmp_path / 'my_reward.py'}:6: UserWarning: a slow path"), lines
    # (the Python warning's text goes on with its source line) no info line, and no other module's warning
    assert not any("scoring" in line or "not the user's" in line for line in lines), lines
