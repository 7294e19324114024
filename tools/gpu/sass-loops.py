"""Instruction mix of the tensor-core loops of one kernel, from `cuobjdump -sass` text: every
backward branch whose body holds HMMA instructions is a loop (the K loop, or the token-tile
loop around it); prints its length and the count of the opcodes that matter for the tile
kernels (MMAs, shared loads, global loads, spills, decode arithmetic). Used by
tools/gpu/sass-loops.sh; stdlib only.

usage: sass-loops.py SASS.txt FUNCTION [--all]   (--all: every loop, not only HMMA loops)
"""
import re, sys, collections
txt=open(sys.argv[1]).read().split('\n')
func=sys.argv[2]
# collect instructions of the function
start=None
ins=[]
for i,l in enumerate(txt):
    if 'Function : ' in l:
        name=l.split('Function : ')[1].strip()
        if start is not None: break
        if name==func: start=i
        continue
    if start is None: continue
    m=re.match(r'\s*/\*([0-9a-f]{4,})\*/\s+(.*?);', l)
    if m:
        addr=int(m.group(1),16); body=m.group(2).strip()
        ins.append((addr, body))
addr_idx={a:k for k,(a,b) in enumerate(ins)}
loops=[]
for k,(a,b) in enumerate(ins):
    m=re.search(r'\bBRA\b.*?`?\(?\.L_x_\d+\)?|BRA\s+(0x[0-9a-f]+)', b)
    mm=re.search(r'BRA[^`]*`?\(?(0x[0-9a-f]+)', b)
    if mm:
        t=int(mm.group(1),16)
        if t < a and t in addr_idx:
            body=ins[addr_idx[t]:k+1]
            ops=collections.Counter(re.sub(r'^@!?U?P\w+\s+','',x[1]).split()[0].split('.')[0] for x in body)
            if ops['HMMA']>0 or '--all' in sys.argv:
                loops.append((t,a,len(body),ops))
for t,a,n,ops in loops:
    keys=['HMMA','IDP','DP4A','LDSM','LDS','STS','LDG','LDGSTS','STL','LDL','HMUL2','PRMT','FMUL','FFMA','FADD','F2FP','I2F','LOP3','SHF','IMAD','IADD3','BAR','LEA','SEL','ISETP']
    print(f"loop {t:#x}-{a:#x}: {n} instr; "+", ".join(f"{k} {ops[k]}" for k in keys if ops[k]))
