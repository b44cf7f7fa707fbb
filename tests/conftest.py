import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_terminal_summary(terminalreporter):
    """Each comparison of choices judged where the reference decides them (tests/bounds.py): how
    many positions it could judge, so a reader sees that none passed by judging nothing."""
    from bounds import JUDGED, MEASURED

    for title, lines in (("inexact results within their bounds", MEASURED),
                         ("choices judged beyond their bounds", JUDGED)):
        if lines:
            terminalreporter.section(title)
            for line in lines:
                terminalreporter.write_line(line)
