"""``edgeq bundle``: build the offline installer for a box."""

from __future__ import annotations

import argparse
from pathlib import Path


def run_bundle_command(args: argparse.Namespace) -> int:
    from edgeq.deploy.bundle import run_bundle_command as run  # pip, hashing: only when it runs

    return run(
        variant=args.variant, out_dir=args.out, model_dir=args.model_dir,
        model_id=args.model, revision=args.revision, model_name=args.model_name,
        version_suffix=args.version_suffix, wheelhouse_from=args.wheelhouse_from,
        python_version=args.python_version, platform=args.platform, keep_dir=args.keep_dir,
        edgeq_wheel=args.edgeq_wheel,
    )  # fmt: skip


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``bundle`` to the ``edgeq`` parser."""
    bundle = commands.add_parser(
        "bundle", help="build one offline .tar (wheels, model, units, install.sh) for a box"
    )
    bundle.add_argument("--variant", choices=["gpu", "cpu"], required=True)
    source = bundle.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-dir", type=Path, help="a local model directory")
    source.add_argument("--model", help="a Hugging Face id, downloaded once (needs --revision)")
    bundle.add_argument("--revision", help="the model's pinned revision (a commit sha)")
    bundle.add_argument("--model-name", help="directory name on the box (default: from the model)")
    bundle.add_argument("--out", type=Path, default=Path("dist"), help="(default: ./dist)")
    bundle.add_argument(
        "--version-suffix", default="", help="append +SUFFIX to edgeq's version (a rebuild)"
    )
    bundle.add_argument(
        "--wheelhouse-from", type=Path, help="reuse the wheels in DIR instead of downloading them"
    )
    bundle.add_argument("--python-version", help="the box's Python, e.g. 3.11 (default: this one)")
    bundle.add_argument("--platform", help="the box's wheel platform, e.g. manylinux_2_28_x86_64")
    bundle.add_argument(
        "--edgeq-wheel",
        type=Path,
        help="bundle this edgeq wheel (default: built from the checkout; needed without one)",
    )
    bundle.add_argument("--keep-dir", action="store_true", help="also keep the unpacked bundle")
    bundle.set_defaults(handler=run_bundle_command)
