"""placeholder"""

from __future__ import annotations

import argparse


def run_ray_serve(args: argparse.Namespace) -> int:
    raise NotImplementedError
