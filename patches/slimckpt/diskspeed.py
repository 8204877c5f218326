"""`python -m slimckpt.diskspeed DIR`: a filesystem's sequential bandwidth, as checkpoints use it (the
code is in `slimckpt.observe.diskspeed`)."""

from .observe.diskspeed import main

if __name__ == "__main__":
    raise SystemExit(main())
