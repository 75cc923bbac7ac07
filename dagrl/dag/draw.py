"""Pictures of a graph and its per-rank plan: Graphviz DOT text, or a self-drawn SVG.

`dagrl plan --format dot` prints DOT (render it with `dot -Tpng`); `--format svg` and the run
report use `to_svg`, which needs no Graphviz: nodes are laid out in layers by their longest
path from a source (a node sits one layer below its deepest dependency), and each rank's task
list is drawn as a column beside the graph.
"""

from __future__ import annotations

import itertools
from html import escape

from dagrl.dag.planner import RankPlan, Task
from dagrl.dag.spec import GraphSpec

# Fill colours: training roles, forward-only model roles, the rest; reshard and balance tasks.
TRAIN_ROLES = {"actor_update", "critic_update"}
MODEL_ROLES = {"rollout", "old_logprob", "ref_logprob", "values", "greedy_baseline"}
COLOURS = {"train": "#f4a582", "model": "#92c5de", "other": "#d9f0d3",
           "reshard": "#fddbc7", "balance": "#e7d4e8"}


# The legend under the graph: (colour key, what it marks).
LEGEND = [("train", "training node"), ("model", "model forward / generation"),
          ("other", "reward, advantage, other"), ("reshard", "reshard"),
          ("balance", "balance")]
# Several policies (config `models`): each extra model's nodes get an outline colour, and
# edges where data passes from one policy's nodes to another's are drawn in CROSS_MODEL.
MODEL_OUTLINES = ["#1b7837", "#762a83", "#b35806", "#2166ac"]
CROSS_MODEL = "#d6604d"


def model_outlines(graph: GraphSpec) -> dict[str, str]:
    """Outline colour per policy: '' (the main one) black, each extra model its own."""
    extra = sorted({n.model for n in graph.nodes if n.model})
    return {"": "#333", **{m: MODEL_OUTLINES[i % len(MODEL_OUTLINES)]
                           for i, m in enumerate(extra)}}


def _colour(role: str) -> str:
    if role in TRAIN_ROLES:
        return COLOURS["train"]
    return COLOURS["model"] if role in MODEL_ROLES else COLOURS["other"]


def _task_colour(task: Task) -> str:
    if task.kind == "node":
        return _colour(task.role)
    return COLOURS.get(task.kind, COLOURS["reshard"])   # replicate / unreplicate: moves too


def _label(node_id: str, role: str) -> str:
    return node_id if node_id == role else f"{node_id} [{role}]"


def to_dot(graph: GraphSpec, order: list[str], plans: list[RankPlan]) -> str:
    """The graph, and one cluster per rank with its tasks in order."""
    q = _dot_quote
    outlines = model_outlines(graph)
    lines = [f"digraph {q(graph.name)} {{", "  rankdir=TB;", "  compound=true;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=11];',
             f"  subgraph cluster_graph {{ label={q('graph ' + graph.name)};"]
    for node_id in order:
        node = graph.node(node_id)
        extra = f"\nranks {','.join(map(str, node.options['ranks']))}" \
            if "ranks" in node.options else ""
        if node.model:
            extra += f"\nmodel {node.model}"
        lines.append(f"    {q('n:' + node_id)} [label={q(_label(node_id, node.role) + extra)}, "
                     f"fillcolor={q(_colour(node.role))}, "
                     f"color={q(outlines[node.model])}, penwidth={2 if node.model else 1}];")
    for node_id in order:
        node = graph.node(node_id)
        for dep in node.deps:
            cross = (f" [color={q(CROSS_MODEL)}, penwidth=2, label={q('data between models')}]"
                     if graph.node(dep).model != node.model else "")
            lines.append(f"    {q('n:' + dep)} -> {q('n:' + node_id)}{cross};")
    lines.append("  }")
    for plan in plans:
        lines.append(f"  subgraph cluster_rank{plan.rank} {{ label={q(f'rank {plan.rank}')};")
        ids = [f"r{plan.rank}:{i}" for i in range(len(plan.tasks))]
        for i, (tid, task) in enumerate(zip(ids, plan.tasks, strict=True), 1):
            lines.append(f"    {q(tid)} [label={q(f'{i}. {task.describe()}')}, "
                         f"fillcolor={q(_task_colour(task))}];")
        for a, b in itertools.pairwise(ids):
            lines.append(f"    {q(a)} -> {q(b)} [style=dashed];")
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def layers(graph: GraphSpec, order: list[str]) -> dict[str, int]:
    """Node id -> layer: 0 for sources, else one more than its deepest dependency."""
    depth: dict[str, int] = {}
    for node_id in order:        # topological: dependencies come first
        deps = graph.node(node_id).deps
        depth[node_id] = 1 + max((depth[d] for d in deps), default=-1)
    return depth


CHAR_W, BOX_H, ROW_GAP, COL_GAP, PAD = 7.0, 30, 28, 24, 16
SWATCH = 12


def _node_label(graph: GraphSpec, node_id: str) -> str:
    """`id [role]`, with `@0,1` when the node is placed on a subset of ranks and `(model)`
    when it belongs to an extra policy."""
    node = graph.node(node_id)
    ranks = node.options.get("ranks")
    return (_label(node_id, node.role) + (f" @{','.join(map(str, ranks))}" if ranks else "")
            + (f" ({node.model})" if node.model else ""))


def to_svg(graph: GraphSpec, order: list[str], plans: list[RankPlan]) -> str:
    """A standalone SVG: the graph on the left, one column per rank's task list on the right."""
    depth = layers(graph, order)
    rows: dict[int, list[str]] = {}
    for node_id in order:
        rows.setdefault(depth[node_id], []).append(node_id)
    labels = {n: _node_label(graph, n) for n in order}
    width_of = {n: CHAR_W * len(labels[n]) + 20 for n in order}
    row_widths = {d: sum(width_of[n] for n in ids) + COL_GAP * (len(ids) - 1)
                  for d, ids in rows.items()}
    outlines = model_outlines(graph)
    # Legend entries for the policies, when there are several: (fill, outline, meaning).
    model_legend = [("white", c, f"model {m or 'main policy'}") for m, c in outlines.items()]
    if len(outlines) > 1:
        model_legend.append((CROSS_MODEL, CROSS_MODEL, "data between models"))
    else:
        model_legend = []
    legend_w = SWATCH + 6 + CHAR_W * max(len(m) for m in [*(m for _, m in LEGEND),
                                                          *(m for _, _, m in model_legend)])
    graph_w = max(max(row_widths.values()), legend_w) + 2 * PAD
    title_h = 28
    pos: dict[str, tuple[float, float]] = {}      # centre of each node's box
    for d, ids in rows.items():
        x = PAD + (graph_w - 2 * PAD - row_widths[d]) / 2
        for n in ids:
            pos[n] = (x + width_of[n] / 2, title_h + PAD + d * (BOX_H + ROW_GAP) + BOX_H / 2)
            x += width_of[n] + COL_GAP
    parts: list[str] = [_text(PAD, 20, f"graph {graph.name}", bold=True)]
    for n in order:                               # edges first, boxes on top
        x2, y2 = pos[n]
        for dep in graph.node(n).deps:
            x1, y1 = pos[dep]
            cross = graph.node(dep).model != graph.node(n).model
            stroke, w = (CROSS_MODEL, 2.2) if cross else ("#555", 1.2)
            cls = ' class="cross-model"' if cross else ""
            parts.append(f'<line x1="{x1:.1f}" y1="{y1 + BOX_H / 2:.1f}" x2="{x2:.1f}" '
                         f'y2="{y2 - BOX_H / 2:.1f}" stroke="{stroke}" stroke-width="{w}" '
                         f'marker-end="url(#arrow)"{cls}/>')
    for n in order:
        node = graph.node(n)
        parts.append(_box(pos[n][0] - width_of[n] / 2, pos[n][1] - BOX_H / 2, width_of[n],
                          _colour(node.role), labels[n], node_id=n,
                          outline=outlines[node.model]))
    graph_h = title_h + PAD + len(rows) * (BOX_H + ROW_GAP)
    # Legend: a swatch and its meaning per colour, one per line under the graph.
    for i, (key, meaning) in enumerate(LEGEND):
        y = graph_h + i * (SWATCH + 4)
        parts.append(f'<g class="legend"><rect x="{PAD:.1f}" y="{y:.1f}" width="{SWATCH}" '
                     f'height="{SWATCH}" fill="{COLOURS[key]}" stroke="#333" stroke-width="1"/>'
                     + _text(PAD + SWATCH + 6, y + SWATCH - 2, meaning) + "</g>")
    graph_h += len(LEGEND) * (SWATCH + 4)
    for i, (fill, outline, meaning) in enumerate(model_legend):
        y = graph_h + i * (SWATCH + 4)
        parts.append(f'<g class="legend"><rect x="{PAD:.1f}" y="{y:.1f}" width="{SWATCH}" '
                     f'height="{SWATCH}" fill="{fill}" stroke="{outline}" stroke-width="2"/>'
                     + _text(PAD + SWATCH + 6, y + SWATCH - 2, meaning) + "</g>")
    graph_h += len(model_legend) * (SWATCH + 4)
    # Per-rank task lists, side by side.
    x = graph_w + 2 * PAD
    plan_h = 0.0
    for plan in plans:
        texts = [f"{i}. {t.describe()}" for i, t in enumerate(plan.tasks, 1)]
        col_w = CHAR_W * max(map(len, texts), default=10) + 20
        parts.append(_text(x, 20, f"rank {plan.rank}", bold=True))
        y = title_h + PAD
        for task, text in zip(plan.tasks, texts, strict=True):
            parts.append(_box(x, y, col_w, _task_colour(task), text, rounded=task.kind == "node"))
            y += BOX_H + 6
        plan_h = max(plan_h, y)
        x += col_w + COL_GAP
    width, height = x + PAD, max(graph_h, plan_h) + PAD
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="Helvetica, Arial, sans-serif" '
            f'font-size="12">\n<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" '
            f'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
            f'<path d="M 0 0 L 10 5 L 0 10 z" fill="#555"/></marker></defs>\n'
            f'<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(parts) + "\n</svg>\n")


def _box(x: float, y: float, w: float, fill: str, label: str, rounded: bool = True,
         node_id: str = "", outline: str = "#333") -> str:
    r = 6 if rounded else 0
    data = f' data-node="{escape(node_id)}"' if node_id else ""
    width = 1 if outline == "#333" else 2.5
    return (f'<g{data}><rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{BOX_H}" rx="{r}" '
            f'fill="{fill}" stroke="{outline}" stroke-width="{width}"/>'
            + _text(x + w / 2, y + BOX_H / 2 + 4, label, anchor="middle") + "</g>")


def _text(x: float, y: float, text: str, bold: bool = False, anchor: str = "start") -> str:
    weight = ' font-weight="bold"' if bold else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{weight}>'
            f"{escape(text)}</text>")
