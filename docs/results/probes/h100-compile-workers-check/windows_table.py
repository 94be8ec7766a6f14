"""The table of a call's window runs (exp/probe_window.py): each run's tree (from gpu.txt), its load and the load's parts,
the iterations of its second window (the one after the load), those over 20 ms, medians, our threads' wait for a CPU, and the
processes beside ours.  python windows_table.py CALL_FOLDER > CALL_FOLDER/windows.md"""
import json, statistics as st, sys, glob, re
gpu = open(sys.argv[1] + '/gpu.txt').read()
trees = dict(re.findall(r"window run (\d+) \((\S+)", gpu))
print("| run | tree | load (s) | checkpoint | engines | engine | workers let go | iterations | over 20 ms | last over 20 ms (s) | preprocessing median (ms) | pinned copy median (ms) | waiting for a CPU, sum (ms) | processes beside ours after the load / at the end (PSS MiB) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for f in sorted(glob.glob(sys.argv[1] + '/window-*.json'), key=lambda p: int(re.findall(r'(\d+)\.json', p)[0])):
    n = re.findall(r'(\d+)\.json', f)[0]
    d = json.load(open(f)); rows = d["windows"][1]["rows"]; t = d.get("load_timings") or {}
    slow = [r for r in rows if r["process_image"] > 20]
    a, e = d.get("descendants_after_load") or {}, d.get("descendants_at_end") or {}
    print(f"| {n} | {trees.get(n)} | {d['load_s']:.1f} | {t.get('model_s', 0):.2f} | {t.get('engines_s', 0):.2f} | {t.get('engine_s', 0):.2f} | {t.get('capture_s', 0):.2f} | {len(rows)} | {len(slow)} | {slow[-1]['t'] if slow else '–'} | {st.median(r['process_image'] for r in rows):.1f} | {st.median(r['pin'] for r in rows):.2f} | {sum(r['runq_wait_us'] for r in rows) / 1e3:.1f} | {len(a.get('processes', []))} ({a.get('pss_kib', 0) // 1024}) / {len(e.get('processes', []))} ({e.get('pss_kib', 0) // 1024}) |")
