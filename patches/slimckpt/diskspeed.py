"""`python -m slimckpt.diskspeed DIR`: a filesystem's sequential bandwidth, as checkpoints use it (the
code is in `slimckpt.observe.diskspeed`)."""

from .observe.diskspeed import main

if __name__ == "__main__":
    from slimckpt.log import cli_logging

    with cli_logging():
        raise SystemExit(main())
