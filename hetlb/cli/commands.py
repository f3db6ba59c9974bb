"""The ``hetlb`` command (also ``python -m hetlb``).

Subcommands:

* ``demo``: the main job (:mod:`hetlb.cli.demo`): balanced training on an emulated paper cluster,
  every policy against uniform, from the same initial weights.
* ``profile``: LBB's profiling phase for a model (built-in or ``MODULE:FACTORY``) on this machine.
* ``plan``: the split of a global batch over workers described by time models (profile JSON
  files from :meth:`hetlb.Profile.save`, inline ``--linear A0,A1`` models, or a scenario's
  workers), for the equal split, LBB's exact solver and LB-BSP's proportional rule.
* ``simulate``: run policies on a scenario in the simulator (:func:`hetlb.sim.simulate`) and
  compare them.
* ``report``: summarise and plot a run log written by ``Balancer(log_dir=...)``.

Every subcommand has ``--help``; those that print a table take ``--json``.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence

import numpy as np


__all__ = ["main", "build_parser"]

log = logging.getLogger("hetlb.cli")


class CLIError(Exception):
    """A usage error: printed as ``hetlb <cmd>: error: ...`` with exit status 2."""


# ------------------------------------------------------------------------------------- helpers


def _ints(text: str, what: str, minimum: int = 0) -> List[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"{what}: expected an integer or comma-separated integers, got {text!r}") from None
    if not vals or any(v < minimum for v in vals):
        kind = "non-negative" if minimum == 0 else "positive" if minimum == 1 else f">= {minimum}"
        raise CLIError(f"{what}: expected {kind} integers, got {text!r}")
    return vals


def _writable(path: Optional[str], flag: str, plot: bool = False) -> None:
    """Refuse an output path before the work, not after it: its directory must exist, and a
    plot needs matplotlib."""
    if not path:
        return
    import os
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CLIError(f"{flag} {path}: the directory {parent} does not exist")
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CLIError(f"{flag} needs matplotlib, one of the optional packages of hetlb[demo]: "
                           f"pip install 'hetlb[demo]'") from None


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str], align: str = "") -> str:
    cells = [[str(h) for h in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = []
    for j, r in enumerate(cells):
        parts = []
        for i, c in enumerate(r):
            left = (align[i] if i < len(align) else "r") == "l"
            parts.append(c.ljust(widths[i]) if left else c.rjust(widths[i]))
        out.append("  ".join(parts).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _describe(m: Any) -> str:
    from hetlb.core.models import LinearModel, PiecewiseModel, PolyModel
    from hetlb.sim import WorkerModel
    if isinstance(m, WorkerModel):
        d = _describe(m.base)
        extra = [f"/{m.speed:g}" if m.speed != 1 else "", f" sat {m.saturation:g}" if m.saturation else "",
                 f" +{m.overhead:g}" if m.overhead else ""]
        return d + "".join(extra)
    if isinstance(m, LinearModel):
        return f"{m.a0:.4g} + {m.a1:.4g} b"
    if isinstance(m, PolyModel):
        return "cubic " + ",".join(f"{c:.3g}" for c in m.coeffs)
    if isinstance(m, PiecewiseModel):
        return f"piecewise ({len(m.batch_sizes)} points)"
    return type(m).__name__


# ------------------------------------------------------------------------------------- plan


def _plan(args: argparse.Namespace) -> int:
    from hetlb.core.models import LinearModel
    from hetlb.train.profile import Profile
    from hetlb.sim import compare_splits, load_scenario

    models: List[Any] = []
    names: List[str] = []
    descs: List[str] = []
    upper: Optional[List[int]] = None
    scale, unit = 1e3, "ms"  # profiles and scenarios are in seconds
    sources = sum(bool(x) for x in (args.profiles, args.linear, args.scenario))
    if sources != 1:
        raise CLIError("give the workers one way: profile JSON files, --linear A0,A1 (one per "
                       "worker), or --scenario NAME|FILE")
    global_batch = args.global_batch
    from hetlb.core.decisions import EXACT_INT
    if global_batch is not None and not 1 <= global_batch < EXACT_INT:
        raise CLIError(f"--global-batch must be in [1, {EXACT_INT}) (the Balancer's range), got "
                       f"{global_batch}")
    if args.profiles:
        limits = []
        for path in args.profiles:
            try:
                p = Profile.load(path)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CLIError(f"{path}: not a readable hetlb profile ({e})") from None
            models.append(p.fit(args.model))
            names.append(path)
            descs.append(_describe(models[-1]))
            limits.append(int(p.limit) if p.oom_at is not None else None)
        if any(x is not None for x in limits):
            upper = [x if x is not None else 2 ** 62 for x in limits]
    elif args.linear:
        scale, unit = 1.0, "(model units)"
        for i, text in enumerate(args.linear):
            try:
                a0, a1 = (float(x) for x in text.split(","))
            except ValueError:
                raise CLIError(f"--linear #{i}: expected A0,A1 (time = A0 + A1*b), got {text!r}") from None
            try:
                models.append(LinearModel(a0, a1))
            except ValueError as e:
                raise CLIError(f"--linear #{i} {text!r}: {e}") from None
            names.append(f"worker {i}")
            descs.append(_describe(models[-1]))
    else:
        sc = load_scenario(args.scenario)
        active = [w for w in sc.workers if w.active]
        top = sc.global_batch if global_batch is None else global_batch
        models = [w.time_model.as_piecewise(top) for w in active]
        names = [w.name or f"worker {i}" for i, w in enumerate(active)]
        descs = [_describe(w.time_model) for w in active]
        global_batch = sc.global_batch if global_batch is None else global_batch
        if any(w.limit is not None for w in active):
            upper = [w.limit if w.limit is not None else 2 ** 62 for w in active]
    if global_batch is None:
        raise CLIError("--global-batch is required (samples per step over all workers)")
    if len(models) > global_batch:
        raise CLIError(f"--global-batch {global_batch} is smaller than the {len(models)} workers: "
                       f"every worker takes at least one sample")
    if args.upper is not None:
        up = _ints(args.upper, "--upper")
        if len(up) not in (1, len(models)):
            raise CLIError(f"--upper: give one bound or one per worker ({len(models)}), got {len(up)}")
        upper = up * len(models) if len(up) == 1 else up
    if upper is not None:
        upper = [min(u, global_batch) for u in upper]
        if sum(upper) < global_batch:
            where = "--upper" if args.upper is not None else "the workers' memory limits"
            raise CLIError(f"{where}: the bounds sum to {sum(upper)}, below --global-batch "
                           f"{global_batch}: raise them or lower --global-batch")
    try:
        splits = compare_splits(models, global_batch, upper=upper)
    except ValueError as e:
        raise CLIError(str(e)) from None
    if args.json:
        print(json.dumps({"global_batch": global_batch, "unit": "s" if scale == 1e3 else "model",
                          "workers": [{"name": n, "model": d} for n, d in zip(names, descs)],
                          "upper": upper, "splits": [s.to_dict() for s in splits]}, indent=1))
        return 0
    label = {"uniform": "uniform (SSGD)", "lbb": "LBB (exact)", "lbbsp": "LB-BSP (proportional)"}
    header = ["worker", "model"]
    for s in splits:
        header += [label[s.rule], f"time {unit}"]
    rows: List[List[Any]] = []
    for i, (n, d) in enumerate(zip(names, descs)):
        row: List[Any] = [n, d]
        for s in splits:
            row += [int(s.sizes[i]), f"{s.times[i] * scale:.2f}"]
        rows.append(row)
    for what, fmt in (("step time", lambda s: f"{s.step * scale:.2f}"),
                      ("straggler effect", lambda s: f"{s.se:.3f}"),
                      ("speed-up over uniform", lambda s: f"{s.speedup:.2f}x")):
        row = [what, ""]
        for s in splits:
            row += [int(s.sizes.sum()) if what == "step time" else "", fmt(s)]
        rows.append(row)
    print(f"global batch {global_batch} over {len(models)} workers"
          + (f", upper bounds {upper}" if upper is not None else ""))
    print(_table(rows, header, align="ll"))
    return 0


# ------------------------------------------------------------------------------------- simulate


def _simulate(args: argparse.Namespace) -> int:
    from hetlb.sim import (POLICY_NAMES, builtin_scenarios, generate_cluster, load_scenario,
                           make_policy, simulate, unknown_policies)
    from hetlb.sim.engine import policy_key

    if args.list:
        for name, make in sorted(builtin_scenarios().items()):
            sc = make()
            print(f"{name:18s} {sc.world:5d} workers  batch {sc.global_batch:6d}  {sc.description}")
        return 0
    if args.seed is not None and args.seed < 0:
        raise CLIError(f"--seed must be >= 0, got {args.seed}")
    if args.steps is not None and args.steps < 1:
        raise CLIError(f"--steps must be >= 1, got {args.steps}")
    if args.global_batch is not None and args.global_batch < 1:
        raise CLIError(f"--global-batch must be >= 1, got {args.global_batch}")
    _writable(args.plot, "--plot", plot=True)
    if args.workers is not None:
        if args.scenario:
            raise CLIError("give a scenario or --workers N, not both")
        if args.workers < 1:
            raise CLIError(f"--workers must be >= 1, got {args.workers}")
        sc = generate_cluster(args.workers, global_batch=args.global_batch, seed=args.seed or 0)
    else:
        sc = load_scenario(args.scenario or "abs-sgd-1234")
        if args.global_batch is not None:
            sc.global_batch = args.global_batch
            sc.check()
    policies = [p for p in args.policy.split(",") if p.strip()]
    bad = unknown_policies(policies)
    if bad or not policies:
        raise CLIError(f"--policy: unknown {bad or policies}; expected a comma-separated subset of "
                       f"{','.join(POLICY_NAMES)}")
    steps = sc.steps if args.steps is None else args.steps
    if args.exchange_every is not None and args.exchange_every < 1:
        raise CLIError(f"--exchange-every must be >= 1, got {args.exchange_every}")
    if args.adaptive_exchange and args.exchange_every == 1:
        raise CLIError("--adaptive-exchange grows blocks up to --exchange-every K steps: pass K > 1")
    if args.adaptive_exchange and args.exchange_every is None:
        # (uniform, which reads no telemetry, has adaptive blocks by default; the others exchange
        # every step unless given K)
        per_step = [p for p in policies if getattr(make_policy(p), "reads_telemetry", True)]
        if per_step:
            raise CLIError(f"--adaptive-exchange grows blocks up to --exchange-every K steps, and "
                           f"{','.join(per_step)} exchange every step by default: pass K > 1")
    hold = args.chronica_hold
    if hold is not None:
        if not (0.0 <= hold < 1.0):
            raise CLIError(f"--chronica-hold must be in [0, 1), got {hold}")
        if not any(policy_key(p) == "chronica" for p in policies):
            raise CLIError("--chronica-hold sets Chronica(hold=H): add chronica to --policy")
    quad = args.chronica_quadratic
    if quad is not None:
        if quad != "fit":
            try:
                quad = float(quad)
            except ValueError:
                raise CLIError(f"--chronica-quadratic must be a number >= 0 or 'fit', got {quad!r}") from None
            if not (quad >= 0.0 and math.isfinite(quad)):
                raise CLIError(f"--chronica-quadratic must be a number >= 0 or 'fit', got {quad}")
        if not any(policy_key(p) == "chronica" for p in policies):
            raise CLIError("--chronica-quadratic sets Chronica(quadratic=C): add chronica to --policy")
    results = []
    for p in policies:
        if policy_key(p) == "chronica" and (hold is not None or quad is not None):
            kw = {"hold": hold} if hold is not None else {}
            if quad is not None:
                kw["quadratic"] = quad
            p = make_policy(p, **kw)
        results.append(simulate(sc, p, steps, profile=args.profile, seed=args.seed,
                                progress=not args.json, exchange_every=args.exchange_every,
                                adaptive_exchange=args.adaptive_exchange))
    base = next((r for r in results if r.policy == "uniform"), None)
    summ = [r.summary() for r in results]
    for s in summ:
        s["speedup"] = (base.total_time / s["total_time"]) if base is not None and s["total_time"] > 0 else None
    if args.json:
        print(json.dumps({"scenario": sc.name, "workers": sc.world, "global_batch": sc.global_batch,
                          "steps": steps, "results": summ}, indent=1))
    else:
        print(f"scenario {sc.name or '(file)'}: {sc.world} workers, global batch {sc.global_batch}, "
              f"{steps} steps" + (f"\n  {sc.description}" if sc.description else ""))
        header = ["policy", "mean step ms", "last half ms", "speed-up", "mean SE", "sim s"]
        blocks = any(s["exchanges"] < r.steps for s, r in zip(summ, results))
        if blocks:  # how many of the steps exchanged the telemetry
            header.append("exchanges")
        small = sc.world <= 8
        if small:
            header.append("final sizes")
        rows = []
        for s in summ:
            row = [s["policy"], f"{s['mean_step'] * 1e3:.2f}", f"{s['tail_step'] * 1e3:.2f}",
                   "-" if s["speedup"] is None else f"{s['speedup']:.2f}x", f"{s['mean_se']:.3f}",
                   f"{s['wall_seconds']:.1f}"]
            if blocks:
                row.append(str(s["exchanges"]))
            if small:
                row.append(" ".join(str(x) for x in s["final_sizes"]))
            rows.append(row)
        print(_table(rows, header, align="l"))
        for s in summ:
            if s["error"]:
                print(f"  {s['policy']}: stopped early: {s['error']}")
    if args.plot:
        _plot_sim(results, args.plot, sc)
    return 0


def _plot_sim(results: List[Any], path: str, sc: Any) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for r in results:
        axes[0].plot(r.step_time * 1e3, label=r.policy, lw=1)
    axes[0].set_ylabel("step time (ms)")
    axes[0].legend()
    axes[0].set_title(f"{sc.name or 'scenario'}: {sc.world} workers, global batch {sc.global_batch}")
    show = next((r for r in results if r.policy != "uniform"), results[0])
    cols = show.sizes.shape[1]
    for w in range(min(cols, 16)):
        axes[1].plot(show.sizes[:, w], lw=1, label=f"w{w}" if cols <= 8 else None)
    axes[1].set_ylabel(f"batch per worker ({show.policy})")
    axes[1].set_xlabel("step")
    if cols <= 8:
        axes[1].legend(ncol=4, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


# ------------------------------------------------------------------------------------- demo


def _demo(args: argparse.Namespace) -> int:
    from hetlb.cli.demo import plot_demo, run_demo
    policies = [p for p in args.policy.split(",") if p.strip()]
    for flag, value, low in (("--epochs", args.epochs, 1), ("--min-steps", args.min_steps, 0)):
        if value is not None and value < low:
            raise CLIError(f"{flag} must be >= {low}, got {value}")
    try:
        res = run_demo(args.cluster, policies, epochs=args.epochs, progress=not args.json,
                       min_steps=args.min_steps)
    except ImportError as e:
        raise CLIError(f"{e}; the demo needs the demo extras: pip install 'hetlb[demo]'") from None
    except ValueError as e:
        raise CLIError(str(e)) from None
    rows = res.rows()
    if args.json:
        print(json.dumps({"cluster": res.cluster, "world": res.world, "global_batch": res.global_batch,
                          "epochs": res.epochs,
                          "ideal_speedup": res.ideal, "results": rows, "runs": res.runs}, indent=1))
    else:
        print(f"hetlb demo: {res.cluster}, {res.world} ranks (Gloo, emulated speeds), global batch "
              f"{res.global_batch}, digits MLP, {res.epochs} epochs per policy")
        header = ["policy", "s/epoch", "last epoch s", "speed-up", "ideal", "mean SE", "accuracy %",
                  "global loss", "loss vs uniform"]
        table = []
        for r in rows:
            table.append([r["policy"], f"{r['epoch_time']:.2f}", f"{r['last_epoch_time']:.2f}",
                          "-" if r["speedup"] is None else f"{r['speedup']:.2f}x", f"{r['ideal']:.2f}x",
                          f"{r['mean_se']:.3f}", f"{100 * r['accuracy']:.1f}", f"{r['final_loss']:.4f}",
                          "-" if r["loss_rel_diff"] is None else f"{r['loss_rel_diff']:.1e}"])
        print(_table(table, header, align="l"))
        print("speed-up: uniform's last epoch over the policy's; ideal: the best integer split of the "
              "emulated cluster; loss vs uniform: largest relative difference of the global training "
              "loss over all steps (same samples per step, only the split differs)")
    if args.plot:
        plot_demo(res, args.plot)
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


# ------------------------------------------------------------------------------------- profile


def _load_factory(spec: str) -> Any:
    import importlib
    from hetlb.cli.zoo import ZOO
    if spec in ZOO:
        return ZOO[spec]
    if ":" not in spec:
        raise CLIError(f"workload {spec!r}: expected MODULE:FACTORY (e.g. mypkg.models:make) or a "
                       f"built-in ({', '.join(ZOO)})")
    mod, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except ImportError as e:
        raise CLIError(f"workload {spec!r}: cannot import {mod!r} ({e}); is it on PYTHONPATH?") from None
    except AttributeError:
        raise CLIError(f"workload {spec!r}: module {mod!r} has no {attr!r}") from None
    if not callable(fn):
        raise CLIError(f"workload {spec!r}: {attr!r} is not callable")
    return fn


def _profile(args: argparse.Namespace) -> int:
    import torch
    from hetlb.train.profile import profile
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise CLIError(f"--device: expected cpu or cuda[:N], got {args.device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {args.device}: this torch build sees no CUDA device")
    if args.memory_limit is not None and not args.memory_limit > 0:
        raise CLIError(f"--memory-limit (MiB above the start) must be > 0, got {args.memory_limit}")
    _writable(args.out, "--out")
    factory = _load_factory(args.workload)
    made = factory(device=args.device)
    if not (isinstance(made, tuple) and len(made) == 3 and all(callable(m) for m in made)):
        raise CLIError(f"{args.workload} must return (model, loss_fn, make_batch); got {type(made).__name__}")
    model, loss_fn, make_batch = made

    if args.repeats < 1:
        raise CLIError(f"--repeats must be >= 1, got {args.repeats}")
    if not 0 <= args.trim < args.repeats:
        raise CLIError(f"--trim (the slowest timings dropped per size, default 1) must be in "
                       f"[0, --repeats), got --trim {args.trim} with --repeats {args.repeats}: pass "
                       f"--trim 0, or --repeats {args.trim + 1} or more")
    if args.max_batch < 1:
        raise CLIError(f"--max-batch must be >= 1, got {args.max_batch}")
    sizes = None if args.batch_sizes is None else _ints(args.batch_sizes, "--batch-sizes", minimum=1)
    planned = sizes or [2 ** k for k in range(1, 31) if 2 ** k <= args.max_batch]
    bar = None
    if not args.json:
        from hetlb.core.progress import progress_bar
        # every size runs one warm-up call and the timed repeats; it stops early at out of memory
        bar = progress_bar(total=len(planned) * (1 + args.repeats), desc=f"profile {args.workload}",
                           unit="step", leave=False, disable=None)

    def step(b: int) -> None:
        x, y = make_batch(b)
        loss_fn(model(x), y).backward()
        model.zero_grad(set_to_none=True)
        if bar is not None:
            bar.set_postfix(batch=b, refresh=False)
            bar.update(1)

    try:
        prof = profile(step, sizes, repeats=args.repeats, trim=args.trim, device=args.device,
                       max_batch=args.max_batch,
                       memory_limit=None if args.memory_limit is None else args.memory_limit * 2 ** 20)
    except ValueError as e:
        raise CLIError(str(e)) from None
    finally:
        if bar is not None:
            bar.close()
    if args.out:
        prof.save(args.out)
    if args.json:
        print(json.dumps(prof.to_dict(), indent=1))
        return 0
    print(f"{args.workload} on {prof.device}: limit {prof.limit}"
          + (f" (out of memory at {prof.oom_at})" if prof.oom_at is not None else " (largest size tried)"))
    fit = prof.fit("linear")
    print(_table([[b, f"{t * 1e3:.3f}", f"{b / t:.0f}"] for b, t in zip(prof.batch_sizes, prof.times)],
                 ["batch", "ms per step", "samples/s"]))
    print(f"linear fit: {fit.a0 * 1e3:.3f} ms + {fit.a1 * 1e3:.4f} ms/sample")
    if args.out:
        print(f"wrote {args.out} (use it with: hetlb plan {args.out} ... --global-batch B)")
    return 0


# ------------------------------------------------------------------------------------- report


def _report(args: argparse.Namespace) -> int:
    from hetlb.train.runlog import read_run
    _writable(args.plot, "--plot", plot=True)
    try:
        steps = read_run(args.log)
    except (OSError, ValueError) as e:
        raise CLIError(str(e)) from None
    t = np.array([s["step_time"] for s in steps])
    se = np.array([s["se"] for s in steps])
    epochs: Dict[int, List[int]] = {}
    for i, s in enumerate(steps):
        epochs.setdefault(int(s.get("epoch", 0)), []).append(i)
    actions = dict(Counter(s["action"] for s in steps if s.get("action")))
    # Steps a log lacks (a run resumed from a checkpoint taken inside a telemetry block, or one
    # that stopped between exchanges) or holds twice (a run resumed from an older checkpoint):
    # the summary would otherwise look whole.
    nums = [int(s["step"]) for s in steps]
    present = sorted(set(nums))
    missing = [[a + 1, b - 1] for a, b in zip(present, present[1:]) if b > a + 1]
    repeated = sorted(n for n, c in Counter(nums).items() if c > 1)
    summary = {"steps": len(steps), "ranks": len(steps[0]["batch"]), "policy": steps[0].get("policy", ""),
               "missing": missing, "repeated": repeated,
               "mean_step": float(t.mean()), "median_step": float(np.median(t)), "mean_se": float(se.mean()),
               "first_sizes": steps[0]["batch"], "last_sizes": steps[-1]["batch"], "actions": actions,
               "epochs": [{"epoch": e, "steps": len(ix), "compute_time": float(t[ix].sum()),
                           "mean_se": float(se[ix].mean())} for e, ix in sorted(epochs.items())]}
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"{args.log}: {summary['steps']} steps on {summary['ranks']} ranks, policy "
              f"{summary['policy'] or '?'}; slowest rank's compute a step: mean "
              f"{summary['mean_step'] * 1e3:.2f} ms (median {summary['median_step'] * 1e3:.2f}; the "
              f"wall step adds the last all-reduce and the step boundary), mean SE "
              f"{summary['mean_se']:.3f}")
        print(f"sizes: first {summary['first_sizes']}, last {summary['last_sizes']}"
              + (f"; actions {actions}" if actions else ""))
        print(_table([[e["epoch"], e["steps"], f"{e['compute_time']:.3f}", f"{e['mean_se']:.3f}"]
                      for e in summary["epochs"]], ["epoch", "steps", "slowest-compute s", "mean SE"]))
        if missing:
            n = sum(b - a + 1 for a, b in missing)
            print(f"warning: {n} step(s) missing from the log: "
                  + ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in missing[:10])
                  + (" ..." if len(missing) > 10 else "")
                  + " (trained but not logged: the steps since the last telemetry exchange of a "
                    "run that stopped, or that a checkpoint taken inside a block did not hold; "
                    "call bal.flush() on every rank before such a checkpoint and at the end)")
        if repeated:
            print(f"warning: {len(repeated)} step(s) logged more than once (first: {repeated[0]}): "
                  f"a run resumed from a checkpoint older than its last logged step")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        x = [s["step"] for s in steps]
        fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
        axes[0].plot(x, t * 1e3, lw=1)
        axes[0].set_ylabel("step time (ms, slowest rank)")
        axes[1].plot(x, se, lw=1)
        axes[1].set_ylabel("straggler effect")
        b = np.array([s["batch"] for s in steps])
        for r in range(min(b.shape[1], 16)):
            axes[2].plot(x, b[:, r], lw=1, label=f"rank {r}")
        if b.shape[1] <= 8:
            axes[2].legend(ncol=4, fontsize="small")
        axes[2].set_ylabel("batch size")
        axes[2].set_xlabel("step")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        plt.close(fig)
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


# ------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``hetlb`` command."""
    p = argparse.ArgumentParser(prog="hetlb", description="Load-balanced data-parallel training "
                                "on heterogeneous clusters: demo, profile, plan, simulate, report.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    dm = sub.add_parser("demo", help="balanced training on an emulated paper cluster (the main job)",
                        description="Spawn one local Gloo worker per scenario worker through torch's "
                        "elastic launcher, emulate the cluster's speeds, train a small network on "
                        "scikit-learn's digits once per policy from the same initial weights, and "
                        "compare time per epoch, speed-up, straggler effect, accuracy and the global "
                        "training loss.", epilog="example: hetlb demo --cluster lbb-table2 --epochs 3")
    dm.add_argument("--cluster", default="abs-sgd-1234",
                    help="scenario: abs-sgd-1234 (default, ABS-SGD's 1:2:3:4), abs-sgd-dynamic, "
                         "lbb-table2, lbb-disturbance, or a scenario file")
    dm.add_argument("--policy", default="uniform,lbb,lbbsp,wlbs,dbs",
                    help="comma-separated policies (default uniform,lbb,lbbsp,wlbs,dbs)")
    dm.add_argument("--epochs", type=int, default=4, help="epochs per policy (default 4)")
    dm.add_argument("--min-steps", type=int, default=40,
                    help="raise the epochs until every policy runs this many steps (default 40)")
    dm.add_argument("--plot", default="out/demo.png", help="PNG to write ('' for none; default out/demo.png)")
    dm.add_argument("--json", action="store_true", help="print JSON instead of a table")
    dm.set_defaults(func=_demo)

    pl = sub.add_parser("plan", help="split a global batch over workers from their time models",
                        description="The split of a global batch over workers described by time "
                        "models, for the equal split (SSGD), LBB's exact min-max solver (Eq. 3) and "
                        "LB-BSP's proportional rule (speeds measured at the equal split): batch and "
                        "predicted time per worker, step time, straggler effect and speed-up.",
                        epilog="example: hetlb plan --global-batch 512 --linear 5.89,0.5931 "
                               "--linear 7.15,0.5808 --linear 8.28,0.6023 --linear 50.98,2.6714")
    pl.add_argument("profiles", nargs="*", help="profile JSON files (Profile.save), one per worker")
    pl.add_argument("--linear", action="append", metavar="A0,A1",
                    help="a worker with time A0 + A1*b (any unit; the output uses it); repeat per worker")
    pl.add_argument("--scenario", help="take the workers from a simulator scenario (built-in name or file)")
    pl.add_argument("--global-batch", type=int, help="samples per step over all workers")
    pl.add_argument("--upper", help="largest batch per worker: one number or one per worker, "
                                    "comma-separated (default: profiles' out-of-memory limits)")
    pl.add_argument("--model", choices=["cubic", "linear", "piecewise"], default="cubic",
                    help="model fitted to profiles (default cubic, LBB's)")
    pl.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pl.set_defaults(func=_plan)

    sm = sub.add_parser("simulate", help="compare policies on a simulated cluster",
                        description="Run policies on a scenario in virtual time (the same policy "
                        "objects as real training) and compare step time, speed-up over uniform and "
                        "straggler effect.", epilog="example: hetlb simulate lbb-disturbance "
                        "--policy uniform,lbb,lbbsp --plot sim.png;  hetlb simulate --workers 4096 --steps 1000")
    sm.add_argument("scenario", nargs="?", help="built-in scenario name or JSON/YAML file "
                                                "(default abs-sgd-1234; --list shows the built-ins)")
    sm.add_argument("--list", action="store_true", help="list the built-in scenarios")
    sm.add_argument("--workers", type=int, help="a generated mixed cluster of N GPU-like workers instead")
    sm.add_argument("--steps", type=int, help="steps to simulate (default: the scenario's)")
    sm.add_argument("--global-batch", type=int, help="override the scenario's global batch")
    sm.add_argument("--policy", default="uniform,lbb,lbbsp,wlbs,dbs",
                    help="comma-separated policies (default uniform,lbb,lbbsp,wlbs,dbs; also lbbsp-cpu)")
    sm.add_argument("--profile", action="store_true",
                    help="give policies profiled models of the workers (LBB starts from them)")
    sm.add_argument("--seed", type=int, help="override the scenario's seed")
    sm.add_argument("--exchange-every", type=int, metavar="K",
                    help="Balancer(exchange_every=K): the policy sees K steps' records at once and "
                         "decides once per K steps (default: 1, every step as the papers; uniform, "
                         "which reads no telemetry, adaptive blocks of up to 16)")
    sm.add_argument("--adaptive-exchange", action="store_true", default=None,
                    help="Balancer(adaptive_exchange=True): blocks of 1 step while the sizes move, "
                         "doubling up to K while they hold still")
    sm.add_argument("--chronica-hold", type=float, metavar="H",
                    help="Chronica(hold=H) for --policy chronica (opt-in, not in the paper): keep its "
                         "rule while refits move every rank's predicted time by at most H of the "
                         "step, so --adaptive-exchange blocks can grow")
    sm.add_argument("--chronica-quadratic", metavar="C",
                    help="Chronica(quadratic=C) for --policy chronica (opt-in): a sample's work is "
                         "s + C*s^2, or 'fit' to fit C per rank (a scenario's own \"quadratic\" "
                         "makes the simulated work so)")
    sm.add_argument("--plot", help="write a PNG of step times and batch sizes")
    sm.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sm.set_defaults(func=_simulate)
    pf = sub.add_parser("profile", help="LBB's profiling phase for a model on this machine",
                        description="Time one forward+backward at batch sizes 2, 4, 8, ... until out of "
                        "memory (or --max-batch) per LBB Algorithm 1 and save the profile JSON that "
                        "`hetlb plan` and Balancer(profile=...) read.",
                        epilog="example: hetlb profile cnn --out cnn.json;  hetlb profile mypkg.train:workload "
                               "--device cuda --out gpu0.json")
    pf.add_argument("workload", help="built-in (mlp, cnn, transformer) or MODULE:FACTORY, a function "
                                     "(device=...) returning (model, loss_fn, make_batch)")
    pf.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    pf.add_argument("--out", help="write the profile JSON here")
    pf.add_argument("--batch-sizes", help="comma-separated sizes instead of powers of two")
    pf.add_argument("--max-batch", type=int, default=256, help="largest power of two to try (default 256)")
    pf.add_argument("--repeats", type=int, default=5, help="timed steps per size (default 5)")
    pf.add_argument("--trim", type=int, default=1, help="slowest timings dropped per size (default 1)")
    pf.add_argument("--memory-limit", type=float, help="MiB above the start that counts as out of memory")
    pf.add_argument("--json", action="store_true", help="print the profile JSON")
    pf.set_defaults(func=_profile)

    rp = sub.add_parser("report", help="summarise and plot a past run's telemetry log",
                        description="Read a run log (run.jsonl, written by Balancer(log_dir=...) or "
                        "HETLB_LOG_DIR) and print step times, straggler effect, sizes and per-epoch "
                        "totals; --plot draws them.", epilog="example: hetlb report runs/a/run.jsonl --plot a.png")
    rp.add_argument("log", help="a run.jsonl file or the log directory holding one")
    rp.add_argument("--plot", help="write a PNG of step time, SE and batch sizes")
    rp.add_argument("--json", action="store_true", help="print JSON instead of text")
    rp.set_defaults(func=_report)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``hetlb`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return 2
    from hetlb.sim import ScenarioError
    try:
        return int(args.func(args) or 0)
    except (CLIError, ScenarioError) as e:
        print(f"hetlb {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError) as e:
        # Wrong input that reached a library call (which names it): a message, not a traceback.
        if args.verbose:
            log.exception("hetlb %s failed", args.command)
        print(f"hetlb {args.command}: error: {e}"
              + ("" if args.verbose else f" (hetlb -v {args.command} ... shows the traceback)"),
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
