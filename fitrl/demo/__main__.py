"""`python -m fitrl.demo STAGING SEED`: build the demo assets into STAGING, in this process.

`fitrl.demo.build` runs this in a child process whose environment pins the numeric path
(`fitrl.demo.BUILD_ENV`); run by hand, it builds with whatever the environment says.
"""

import sys
from pathlib import Path

from fitrl.demo import build_into

if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m fitrl.demo STAGING SEED")
    build_into(Path(sys.argv[1]), int(sys.argv[2]))
