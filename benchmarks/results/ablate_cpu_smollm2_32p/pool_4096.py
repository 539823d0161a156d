"""Paired differences of the ablation at 4,096 tokens, 2 %, pooled over two runs on the same 32 prompts:
this folder (CPU, session 30) and ../ablate_h200_smollm2_b8 (H200, batches of 8, session 25). Each pair
(variant, default) comes from one run; the bootstrap resamples the 64 per-prompt differences. Run from the
checkout root: python benchmarks/results/ablate_cpu_smollm2_32p/pool_4096.py"""
import json
from vegas.tune_points import spread
def load(f):
    return json.load(open(f))['points']
cpu=load('benchmarks/results/ablate_cpu_smollm2_32p/points.json')
gpu=load('benchmarks/results/ablate_h200_smollm2_b8/points.json')
def at(pts,sel,variant="default",g=4,ctx=4096,s=0.02):
    r=[p for p in pts if p['selector']==sel and p['variant']==variant and p['num_draft_tokens']==g and p['context']==ctx and p['sparsity_ratio']==s and p['prompt_kind']=='heldout']
    return r[0] if r else None
def diffs(pts,a,b):
    return [x-y for x,y in zip(a['tau_per_prompt'],b['tau_per_prompt'])], b['tau_per_prompt']
def show(label, pairs):
    d=[];ref=[]
    for pts,a,b in pairs:
        A,B=at(pts,*a),at(pts,*b)
        if A and B:
            x,y=diffs(pts,A,B); d+=x; ref+=y
    if not d: print(label,'-'); return
    s=spread(d,0); m=sum(ref)/len(ref)
    print(f"{label:45s} n={len(d):3d} {100*s['mean']/m:+.1f} % [{100*s['ci95'][0]/m:+.1f}, {100*s['ci95'][1]/m:+.1f}]")
for sel in ('collect2','aggregated','last_token'):
    for v in ('granularity=kv_head','recent_window=0','score_mode=weight'):
        for name,runs in (('cpu',[cpu]),('h200',[gpu]),('pooled',[cpu,gpu])):
            show(f"{sel} {v} - default [{name}]", [(r,(sel,v),(sel,)) for r in runs])
for a,b in (('collect2','aggregated'),('collect2','last_token'),('aggregated','last_token')):
    for v in ('default','granularity=kv_head','recent_window=0','score_mode=weight'):
        for name,runs in (('cpu',[cpu]),('h200',[gpu]),('pooled',[cpu,gpu])):
            show(f"{a}-{b} {v} [{name}]", [(r,(a,v),(b,v)) for r in runs])
    for g in (2,6,8):
        for name,runs in (('cpu',[cpu]),('h200',[gpu]),('pooled',[cpu,gpu])):
            show(f"{a}-{b} γ={g} [{name}]", [(r,(a,'default',g),(b,'default',g)) for r in runs])
