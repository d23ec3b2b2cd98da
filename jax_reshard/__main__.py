"""Command line: ``python -m jax_reshard demo [--devices N] [--layers L] [--repeats R]``."""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jax_reshard")
  sub = parser.add_subparsers(dest="command", required=True)
  demo = sub.add_parser("demo", help="refit a transformer-shaped tree trainer -> sampler")
  demo.add_argument("--devices", type=int, default=8, help="simulated CPU devices (even)")
  demo.add_argument("--layers", type=int, default=4, help="transformer layers")
  demo.add_argument("--repeats", type=int, default=7, help="timed repetitions per method")
  args = parser.parse_args(argv)
  import jax

  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", args.devices)
  from jax_reshard import _demo

  return _demo.run(layers=args.layers, repeats=args.repeats)


if __name__ == "__main__":
  sys.exit(main())
