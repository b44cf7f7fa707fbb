import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_terminal_summary(terminalreporter):
    """Inexact comparisons (tests/bounds.py): per test, the worst difference against its bound and
    how many positions its comparisons of choices could judge, so none passes by judging nothing."""
    from bounds import summary_lines

    lines = summary_lines()
    if len(lines) > 1:
        terminalreporter.section("inexact results: bounds and judged positions")
        for line in lines:
            terminalreporter.write_line(line)
