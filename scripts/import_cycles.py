#!/usr/bin/env python3
"""Prints every import cycle (strongly connected component of more than one
module) among remat-runtime's modules, with the edges inside it.
Usage: python3 scripts/import_cycles.py (exits 1 on a cycle; .ci/run runs it)"""
import os, re, collections, sys
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'remat-runtime', 'src')
files = []
for r, d, fs in os.walk(root):
    for f in fs:
        if f.endswith('.rs'):
            files.append(os.path.relpath(os.path.join(r, f), root))
def mod_of(path):
    p = path[:-3]
    if p.endswith('/mod'): p = p[:-4]
    if p == 'lib': p = 'crate'
    return p.replace('/', '::')
mods = {mod_of(f): f for f in files}
edges = collections.defaultdict(dict)
for m, f in mods.items():
    s = open(os.path.join(root, f)).read()
    # strip comments
    s = re.sub(r'//.*', '', s)
    for x in re.findall(r'crate::([a-z_]+(?:::[a-z_]+)*)', s):
        parts = x.split('::')
        for k in range(len(parts), 0, -1):
            cand = '::'.join(parts[:k])
            if cand in mods:
                if cand != m and not m.startswith(cand + '::') and not cand.startswith(m + '::'):
                    edges[m][cand] = 'crate::' + x
                break
    base = m.split('::')[:-1]
    for x in re.findall(r'super::([a-z_]+)', s):
        cand = '::'.join(base + [x])
        if cand in mods and cand != m:
            edges[m][cand] = 'super::' + x
sys.setrecursionlimit(10000)
index, low, st, on, sccs, i = {}, {}, [], set(), [], [0]
def sc(v):
    index[v] = low[v] = i[0]; i[0] += 1; st.append(v); on.add(v)
    for w in edges[v]:
        if w not in index: sc(w); low[v] = min(low[v], low[w])
        elif w in on: low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        c = []
        while True:
            w = st.pop(); on.discard(w); c.append(w)
            if w == v: break
        sccs.append(c)
for v in mods:
    if v not in index: sc(v)
found = False
for c in sccs:
    if len(c) > 1:
        found = True
        print(len(c), 'modules in a cycle:', sorted(c))
        for m in sorted(c):
            for w, via in sorted(edges[m].items()):
                if w in c: print('   ', m, '->', w, '  (', via, ')')
if not found:
    print("no import cycle")
sys.exit(1 if found else 0)
