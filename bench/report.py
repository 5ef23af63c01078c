"""Render a benchmark result (the JSON object a bench script printed) as Markdown tables.

    python3 bench/report.py bench/results/webhookd-latest.json [bench/results/searchkeys-latest.json]
"""
import json
import sys


def fmt(value, digits=2):
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def load_cell(fig):
    if not fig:
        return "–"
    return f"{fmt(fig['rps'])} / {fmt(fig['p50_ms'])} / {fmt(fig['p99_ms'])}"


def webhookd(result):
    lines = ["| scenario | c | client | ours rps / p50 / p99 ms | peer rps / p50 / p99 ms "
             "| floor rps / p50 / p99 ms | rps ours/peer | rps ours/floor | ours max ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for scenario, by_c in result["load"].items():
        for c, by_client in by_c.items():
            for client, row in by_client.items():
                ours = row.get("ours")
                lines.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
                    scenario, c, client, load_cell(ours), load_cell(row.get("peer")),
                    load_cell(row.get("floor")),
                    fmt((row.get("ours/peer") or {}).get("rps")),
                    fmt((row.get("ours/floor") or {}).get("rps")),
                    fmt((ours or {}).get("max_ms"))))
    lines.append("")
    lines.append("| figure | " + " | ".join(r for r in result["idle"]) + " |")
    lines.append("|---|" + "---|" * len(result["idle"]))
    rows = [("startup ms (median)", lambda n: result["startup_ms"][n]["median_ms"]),
            ("idle CPU %", lambda n: result["idle"][n]["cpu_percent"]),
            ("idle RSS MiB", lambda n: result["idle"][n]["rss_mib"]),
            ("RSS after load MiB", lambda n: result["rss_after_load"][n]["rss_mib"]),
            ("peak RSS (VmHWM) MiB", lambda n: result["rss_end"][n]["peak_rss_mib"]),
            ("threads at end", lambda n: result["rss_end"][n]["threads"]),
            ("idle CPU % after load", lambda n: result["idle_after_load"][n]["cpu_percent"]),
            ("hot reload median ms",
             lambda n: result["hot_reload"].get(n, {}).get("median_ms")),
            ("hot reload samples ms",
             lambda n: ", ".join(fmt(v, 1) for v in result["hot_reload"][n]["samples_ms"])
             if n in result["hot_reload"] else None)]
    for label, get in rows:
        lines.append(f"| {label} | " + " | ".join(fmt(get(n)) for n in result["idle"]) + " |")
    lines += webhookd_phase_lines(result)
    return lines


def webhookd_phase_lines(result):
    """The idle RSS over the floor, a run from bytecode, the crowded and background phases."""
    lines = [""]
    if "idle_rss_over_floor_mib" in result:
        lines.append(f"idle RSS ours - floor: {fmt(result['idle_rss_over_floor_mib'])} MiB")
    for name, fig in result.get("idle_informational", {}).items():
        start = result.get("startup_ms", {}).get(name, {}).get("median_ms")
        lines.append(f"{name}: idle RSS {fmt(fig['rss_mib'])} MiB, startup {fmt(start)} ms")
    crowded = {n: v for n, v in result.get("crowded", {}).items() if "/" not in n}
    if crowded:
        lines += ["", "| crowded | new clients | p50 ms | p99 ms | max ms | threads | RSS MiB |",
                  "|---|---|---|---|---|---|---|"]
        for name, fig in crowded.items():
            lines.append(f"| {name} | {fig['new_clients']} / {fig['new_clients'] + fig['failures']}"
                         f" | {fmt(fig['p50_ms'])} | {fmt(fig['p99_ms'])} | {fmt(fig['max_ms'])}"
                         f" | {fmt(fig['threads'])} | {fmt(fig['rss_mib'])} |")
    background = {n: v for n, v in result.get("background", {}).items() if "/" not in n}
    if background:
        lines += ["", "| background | triggers answered | answers s | drain s | peak threads "
                  "| peak commands | peak RSS MiB |", "|---|---|---|---|---|---|---|"]
        for name, fig in background.items():
            lines.append(f"| {name} | {fig['answered_200']} / {fig['triggers']} "
                         f"| {fmt(fig['answers_s'])} | {fmt(fig['drain_s'])} "
                         f"| {fig['peak_threads']} | {fig['peak_children']} "
                         f"| {fmt(fig['peak_rss_mib'])} |")
    return lines


def table_rows(table, names, ratios):
    """Rows of an interleaved comparison: label, each server's figures, the ratios' rps."""
    lines = []
    for label, row in table.items():
        if not isinstance(row, dict) or not all(isinstance(row.get(n), dict) for n in names):
            continue
        cells = [load_cell(row[n]) for n in names]
        cells += [fmt((row.get(r) or {}).get("rps")) for r in ratios]
        cells.append(" / ".join(fmt(row[n].get("server_cpu_us_per_req"), 0) for n in names))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def held_lines(result):
    held = result.get("held_connections")
    if not held:
        return []
    lines = ["", "A new client (GET /health on a fresh connection) while connections are held "
             "against the guard:", "",
             "| held | p50 / p99 / max ms | guard threads | guard RSS MiB |", "|---|---|---|---|"]
    for label, row in held.items():
        if isinstance(row, dict):
            lines.append(f"| {label} | {row['p50_ms']} / {row['p99_ms']} / {row['max_ms']} | "
                         f"{row.get('threads', '')} | {row.get('rss_mib', '')} |")
    return lines


def guard_lines(result):
    lines = []
    if "guard" not in result:  # a --held-only run
        return held_lines(result)
    lines += ["", "Guard: each request shape through `serve --upstream` vs the floor (bare "
              "http.server + http.client proxy) vs direct to the stub:", "",
              "| shape | client | direct rps / p50 / p99 ms | floor rps / p50 / p99 ms "
              "| guarded rps / p50 / p99 ms | rps guarded/floor | rps guarded/direct "
              "| server CPU µs/req (stub / floor / guard) | added p50 ms vs floor |",
              "|---|---|---|---|---|---|---|---|---|"]
    for shape, table in result["guard"].get("shapes", {}).items():
        rows = table_rows(table, ["direct", "floor", "guarded"],
                          ["guarded/floor", "guarded/direct"])
        for row, label in zip(rows, table):
            lines.append(f"| {shape} {row} {fmt(table[label]['added_p50_vs_floor_ms'], 3)} |")
    if "nginx" in result:
        lines += ["", "nginx (the README's recipe: searches through searchkeys serve --upstream; "
                  "other routes auth_request, decisions cached "
                  "5 s) vs nginx alone, both proxying to the stub:", "",
                  "| client | nginx direct rps / p50 / p99 ms | nginx+searchkeys rps / p50 / p99 ms"
                  " | rps ratio | server CPU µs/req |", "|---|---|---|---|---|"]
        lines += table_rows(result["nginx"], ["nginx direct", "nginx+searchkeys"],
                            ["guarded/direct"])
    return lines + held_lines(result)


def searchkeys(result):
    lines = []
    for level, table in result.get("authorize", {}).items():
        big = f"{level} keys"
        names = ["10 keys", big, "floor"]
        lines += ["", f"Authorization (GET /authorize, valid key), {level} vs 10 stored keys:", "",
                  "| client | 10 keys rps / p50 / p99 ms | " + big + " rps / p50 / p99 ms "
                  "| floor rps / p50 / p99 ms | rps big/10 | rps big/floor "
                  "| server CPU µs/req (10 / big / floor) |", "|---|---|---|---|---|---|---|"]
        lines += table_rows(table, names, ["big/10", "big/floor"])
    creates = result.get("creates")
    if creates is None:  # a --guard-only run
        return lines + guard_lines(result)
    names = [n for n in creates["stored_after"]]
    lines += ["", "POST /keys on a durable store (stored keys before; the small store grows "
              f"during the measurement, to {creates['stored_after'][names[0]]}):", "",
              f"| client | {names[0]} creates/s / p50 / p99 ms | {names[1]} creates/s / p50 / p99 ms"
              " | rate big/small | server CPU µs/req |", "|---|---|---|---|---|"]
    lines += table_rows(creates, names, ["big/small"])
    lines += guard_lines(result)
    lines += ["", "startup (spawn → first answer), median wall ms / CPU ms: " + "; ".join(
        f"{k}: {v['median_ms']} / {v['cpu_median_ms']} (wall samples {v['samples_ms']})"
        for k, v in result["startup_ms"].items()),
        f"idle RSS MiB: {result['idle_rss_mib']}; RSS while running: "
        f"{result['rss_mib_running']}; memory per 100k keys: "
        f"{result['memory_mib_per_100k_keys']} MiB; store files {result['store_bytes']} bytes "
        f"for {result['stored_keys_final']} keys"]
    memory = {name: row for name, row in result.get("memory", {}).items() if isinstance(row, dict)}
    if memory:
        lines.append("idle RSS next to a bare http.server script, median MiB: " + "; ".join(
            f"{name}: {row['median_mib']}" + (f" (+{row['over_bare_mib']})"
                                              if "over_bare_mib" in row else "")
            for name, row in memory.items()))
    return lines


def targets(result):
    lines = ["", "| target | measured | limit | met |", "|---|---|---|---|"]
    for t in result["targets"]:
        lines.append(f"| {t['what']} | {fmt(t['value'], 3)} | {t['limit']} | "
                     f"{'yes' if t['met'] else '**no**'} |")
    return lines


def main():
    for path in sys.argv[1:]:
        with open(path) as f:
            result = json.load(f)
        render = webhookd if result["benchmark"] == "webhookd" else searchkeys
        m = result["machine"]
        print(f"### {result['benchmark']} — {result['started_utc']} → {result['finished_utc']}")
        print(f"\nMachine: {m['cpus']} CPU {m['cpu_model']}, {m['memory_gib']} GiB, kernel "
              f"{m['kernel']}, servers on {m.get('server_python')}, {m['wrk']}; load average at start "
              f"{result['load_average']['start']}, at end {result['load_average']['end']}; "
              f"settings {json.dumps(result['settings'])}\n")
        print("\n".join(render(result) + targets(result)))
        print()


if __name__ == "__main__":
    main()
