"""A word-level language model trained over a fixed corpus cut into --batch_size columns, in the pattern of
public example scripts (a corpus batchified into columns, `--flag=value` knobs, an epoch that is however
many windows the columns hold): its steps per epoch fall as the batch grows, and a batch larger than the
corpus has rows for stops it with an error that is not out of memory. For `memdiff fit`
(tests/test_fit_public_patterns.py, docs/fit.md "On public scripts").

    python tests/scenarios/fit_corpus_lm.py --batch_size=16 --tokens=4096 --bptt=8
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader

parser = argparse.ArgumentParser()
parser.add_argument("--batch_size", type=int, required=True)
parser.add_argument("--tokens", type=int, default=4096, help="the corpus's length in tokens")
parser.add_argument("--vocab", type=int, default=2048)
parser.add_argument("--bptt", type=int, default=8, help="tokens per window: one step per window of the columns")
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes handing out the windows")
args = parser.parse_args()

corpus = torch.randint(args.vocab, (args.tokens,))
rows = args.tokens // args.batch_size
if rows < 2:  # one row is no (input, target) pair: an epoch of nothing
    raise ValueError(f"the corpus of {args.tokens} tokens has {rows} row(s) at batch {args.batch_size}: "
                     "nothing to train on")
columns = corpus[:rows * args.batch_size].view(args.batch_size, rows).t().contiguous().cuda()

model = nn.Sequential(nn.Embedding(args.vocab, args.width), nn.Linear(args.width, args.width), nn.Tanh(),
                      nn.Linear(args.width, args.vocab)).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
steps = 0
for _ in range(args.epochs):
    for start in DataLoader(range(0, rows - 1, args.bptt), batch_size=None, num_workers=args.workers):
        length = min(args.bptt, rows - 1 - start)
        inputs, targets = columns[start:start + length], columns[start + 1:start + 1 + length]
        loss = nn.functional.cross_entropy(model(inputs).view(-1, args.vocab), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps += 1
print(f"trained {steps} steps at batch {args.batch_size}")
