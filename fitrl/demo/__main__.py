"""`python -m fitrl.demo build DIR [--seed N]`: build a fresh set of demo assets from a seed, the recipe
that made the shipped ones; `python -m fitrl.demo verify [DIR]`: check a set (default: the shipped one)
against its `SHA256SUMS`. Point the stages at a build of your own with `--demo_assets DIR`."""

from __future__ import annotations

import argparse

from fitrl.config import RunFailed
from fitrl.demo import SHIPPED, manifest, verify
from fitrl.process import entrypoint


@entrypoint
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fitrl.demo", description=__doc__, allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    build_cmd = commands.add_parser("build", help="build the demo assets from a seed into a new folder")
    build_cmd.add_argument("out_dir", help="a new or empty folder")
    build_cmd.add_argument("--seed", type=int, default=None, help="the seed (default: the shipped build's)")
    verify_cmd = commands.add_parser("verify", help="check a set of demo assets against its SHA256SUMS")
    verify_cmd.add_argument("root", nargs="?", default=str(SHIPPED), help="the folder (default: the shipped set)")
    args = parser.parse_args(argv)
    if args.command == "build":
        from fitrl.demo.build import DEFAULT_SEED, build

        out = build(args.out_dir, DEFAULT_SEED if args.seed is None else args.seed)
        figures = manifest(out)
        print(
            f"built {out}: LM test perplexity {figures['lm_test_perplexity']}, "
            f"classifier test accuracy {figures['classifier_test_accuracy']:.1%}"
        )
        return
    manifest(args.root)  # a folder that is no set of assets: one line, exit 2
    problems = verify(args.root)
    if problems:
        raise RunFailed(f"{args.root} differs from its SHA256SUMS: {'; '.join(problems[:5])}")
    print(f"{args.root}: every file matches its SHA256SUMS")


if __name__ == "__main__":
    main()
