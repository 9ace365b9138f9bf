"""The one build step pyproject.toml cannot declare: the presets live in ``configs/`` at the root
of the checkout (docs/design.md's layout) and ship inside the wheel at ``verl_digen/config/``, the
package path where an installed ``verl_digen.config.compose`` and Hydra's
``pkg://verl_digen.config`` find them. A checkout (editable install) reads ``configs/`` in place."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PRESETS = os.path.join(HERE, "configs")
PACKAGED = os.path.join("verl_digen", "config")


class BuildWithPresets(build_py):
    """``build_py`` that also copies every ``configs/**/*.yaml`` into the built package."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads configs/ where it is
            return
        for root, _, names in os.walk(PRESETS):
            for name in sorted(n for n in names if n.endswith(".yaml")):
                src = os.path.join(root, name)
                dst = os.path.join(self.build_lib, PACKAGED, os.path.relpath(src, PRESETS))
                self.mkpath(os.path.dirname(dst))
                self.copy_file(src, dst)


setup(cmdclass={"build_py": BuildWithPresets})
