"""Running the `gdnx` command in the test process."""

from gdnx.cli import main


def refused(capsys, argv) -> str:
    """The one error line of a refused command (a progress bar may precede it)."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.startswith("gdnx ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]
