"""What many tests share: the tiny model configs and the subprocess runner."""
