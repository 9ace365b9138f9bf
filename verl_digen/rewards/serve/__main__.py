"""``python -m verl_digen.rewards.serve``: the reward server's command line (:func:`main`)."""

import sys

from verl_digen.rewards.serve import main

if __name__ == "__main__":
    sys.exit(main())
