"""python -m fastplug.bench micro|e2e|multi|frameworks|varlen|moe-tune|generate|grpo [options]   (each takes --help)"""

import json
import sys

USAGE = (
    "usage: python -m fastplug.bench {micro,e2e,multi,frameworks,varlen,moe-tune,generate,grpo} [options]"
    "   (--help after the command for its options)"
)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "micro":
        from .micro import main as micro_main

        return micro_main(rest)
    if command == "e2e":
        from .e2e import main as e2e_main

        return e2e_main(rest)
    if command == "multi":
        from .multi import main as multi_main

        return multi_main(rest)
    if command == "moe-tune":
        from .moe_tune import main as moe_tune_main

        return moe_tune_main(rest)
    if command == "generate":
        from .generate import main as generate_main

        return generate_main(rest)
    if command == "frameworks":
        from .frameworks import main as frameworks_main

        return frameworks_main(rest)
    if command == "varlen":
        from .varlen import main as varlen_main

        return varlen_main(rest)
    if command == "grpo":
        from .grpo import main as grpo_main

        return grpo_main(rest)
    if command == "_multi_worker":  # internal: every rank of one multi launch
        from .multi import worker_main

        return worker_main(*rest)
    if command == "_worker":  # internal: one run in a fresh process, e2e's or (by its spec) frameworks'
        bench = json.loads(rest[0]).get("bench")
        if bench == "frameworks":
            from .frameworks import worker_main
        elif bench == "varlen":
            from .varlen import worker_main
        elif bench == "grpo":
            from .grpo import worker_main
        else:
            from .e2e import worker_main

        return worker_main(*rest)
    print(f"unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
