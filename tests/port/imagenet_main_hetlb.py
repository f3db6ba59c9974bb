"""tests/port/imagenet_main.py (pytorch/examples' ImageNet training script on CPU and Gloo)
ported to hetlb: the changed lines are counted and the training checked in
tests/test_port_scripts.py.

    torchrun --standalone --nproc-per-node 2 imagenet_main_hetlb.py -j 0 -b 8 --epochs 2 \
        [--train-size 97] [--val-size 53] [--checkpoint checkpoint.pth.tar] [--resume PATH] [-e]

What differs from upstream (everything else is upstream's code, line for line):

* Device and backend: CPU only, Gloo, the torchrun (env://) path only. ``--dist-url`` defaults to
  ``env://`` and ``--dist-backend`` to ``gloo``; the accelerator code (``use_accel``, ``--gpu``,
  ``--no-accel``, ``.cuda()``, DataParallel, cudnn flags) and ``--multiprocessing-distributed``
  (mp.spawn, ``ngpus_per_node``) are gone, so ``main_worker`` takes ``args`` only and
  AverageMeter has no ``use_accel``.
* Stand-ins: torchvision's ImageFolder (and ``--dummy``'s FakeData) is ``SyntheticImages``, a
  deterministic map-style dataset of 3x8x8 tensors in 10 classes (10, so upstream's top-5
  accuracy stays), ``--train-size``/``--val-size`` samples; the transforms are dropped;
  ``models.resnet18`` is ``tinynet`` (conv, BatchNorm, ReLU, pool, linear: it keeps resnet's
  BatchNorm buffers), chosen with ``-a``; ``--pretrained`` and the positional data directory are
  dropped.
* ``--seed`` defaults to 0 (upstream: None), so every run builds the same model.
* save_checkpoint writes ``--checkpoint`` (default checkpoint.pth.tar, upstream's name) and only
  rank 0 saves: upstream's guard only covers --multiprocessing-distributed, so under torchrun
  every rank writes the same file at once.
* ``model = DDP(model)`` on the CPU: upstream wraps the model in DDP only on an accelerator (on
  the CPU it trains each rank's model alone, unsynchronised); this is upstream's torchrun GPU
  path (``model.cuda(); DDP(model)``, no device_ids) without the ``.cuda()``.
* Test instrumentation (PORT_TRACE, the ``port_trace`` calls; kept identical in the port): with
  ``PORT_TRACE=<dir>``, each dataset read appends its index to ``<dir>/<split>-rank<RANK>.txt``
  (reads from DataLoader workers land there too, out of order: the tests use ``-j 0``), the
  epoch loop writes ``epoch <E>`` to the train trace before each epoch and ``val <E>`` to the val
  trace before each validation, and after each validation a line ``result epoch <E> acc1 ...
  params ... buffers ...`` (top-1 and checksums of the parameters and buffers) is printed and
  written to ``<dir>/result-rank<RANK>.txt``.
"""
import argparse
import os
import random
import shutil
import sys
import time
from enum import Enum

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.parallel
import torch.optim
import torch.utils.data
import torch.utils.data.distributed
import hetlb
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import Subset


def port_trace(split, line, echo=False):
    """Test instrumentation: append ``line`` to $PORT_TRACE/<split>-rank<RANK>.txt."""
    trace_dir = os.environ.get("PORT_TRACE")
    if echo:
        sys.stdout.write(f"{line}\n")  # one write: ranks share the terminal
    if trace_dir:
        with open(os.path.join(trace_dir, f"{split}-rank{os.environ.get('RANK', '0')}.txt"), "a") as f:
            f.write(f"{line}\n")


class SyntheticImages(torch.utils.data.Dataset):
    """Stand-in for ImageFolder: ``size`` 3x8x8 images in ``num_classes`` classes, each a
    class template plus noise, the same for the same ``seed``."""

    def __init__(self, split, size, num_classes=10, seed=0):
        self.split = split
        g = torch.Generator().manual_seed(seed)
        templates = torch.randn(num_classes, 3, 8, 8, generator=g)
        g.manual_seed(seed + (1 if split == "train" else 2))
        self.targets = torch.randint(num_classes, (size,), generator=g).tolist()
        self.samples = templates[self.targets] + 1.5 * torch.randn(size, 3, 8, 8, generator=g)
        self.classes = list(range(num_classes))

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        port_trace(self.split, index)
        return self.samples[index], self.targets[index]


def tinynet(num_classes=10):
    """Stand-in for models.resnet18: a conv net with BatchNorm."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, num_classes))


models = {'tinynet': tinynet}
model_names = sorted(models)

parser = argparse.ArgumentParser(description='PyTorch ImageNet Training')
parser.add_argument('-a', '--arch', metavar='ARCH', default='tinynet',
                    choices=model_names,
                    help='model architecture: ' +
                        ' | '.join(model_names) +
                        ' (default: tinynet)')
parser.add_argument('--train-size', default=97, type=int, help='training samples')
parser.add_argument('--val-size', default=53, type=int, help='validation samples')
parser.add_argument('-j', '--workers', default=4, type=int, metavar='N',
                    help='number of data loading workers (default: 4)')
parser.add_argument('--epochs', default=90, type=int, metavar='N',
                    help='number of total epochs to run')
parser.add_argument('--start-epoch', default=0, type=int, metavar='N',
                    help='manual epoch number (useful on restarts)')
parser.add_argument('-b', '--batch-size', default=256, type=int,
                    metavar='N',
                    help='mini-batch size (default: 256), this is the total '
                         'batch size of all GPUs on the current node when '
                         'using Data Parallel or Distributed Data Parallel')
parser.add_argument('--lr', '--learning-rate', default=0.1, type=float,
                    metavar='LR', help='initial learning rate', dest='lr')
parser.add_argument('--momentum', default=0.9, type=float, metavar='M',
                    help='momentum')
parser.add_argument('--wd', '--weight-decay', default=1e-4, type=float,
                    metavar='W', help='weight decay (default: 1e-4)',
                    dest='weight_decay')
parser.add_argument('-p', '--print-freq', default=10, type=int,
                    metavar='N', help='print frequency (default: 10)')
parser.add_argument('--resume', default='', type=str, metavar='PATH',
                    help='path to latest checkpoint (default: none)')
parser.add_argument('--checkpoint', default='checkpoint.pth.tar', type=str, metavar='PATH',
                    help='where to save checkpoints (default: checkpoint.pth.tar)')
parser.add_argument('-e', '--evaluate', dest='evaluate', action='store_true',
                    help='evaluate model on validation set')
parser.add_argument('--world-size', default=-1, type=int,
                    help='number of nodes for distributed training')
parser.add_argument('--rank', default=-1, type=int,
                    help='node rank for distributed training')
parser.add_argument('--dist-url', default='env://', type=str,
                    help='url used to set up distributed training')
parser.add_argument('--dist-backend', default='gloo', type=str,
                    help='distributed backend')
parser.add_argument('--seed', default=0, type=int,
                    help='seed for initializing training. ')

best_acc1 = 0


def main():
    args = parser.parse_args()

    if args.seed is not None:
        random.seed(args.seed)
        torch.manual_seed(args.seed)

    if args.dist_url == "env://" and args.world_size == -1:
        args.world_size = int(os.environ["WORLD_SIZE"])

    args.distributed = args.world_size > 1

    device = torch.device("cpu")

    print(f"Using device: {device}")

    # Simply call main_worker function
    main_worker(args)


def main_worker(args):
    global best_acc1

    device = torch.device("cpu")

    if args.distributed:
        if args.dist_url == "env://" and args.rank == -1:
            args.rank = int(os.environ["RANK"])
        dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url,
                                world_size=args.world_size, rank=args.rank)
    # create model
    print("=> creating model '{}'".format(args.arch))
    model = models[args.arch]()

    if args.distributed:
        # DistributedDataParallel on the CPU: no device_ids
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        model.to(device)


    # define loss function (criterion), optimizer, and learning rate scheduler
    criterion = nn.CrossEntropyLoss().to(device)

    optimizer = torch.optim.SGD(model.parameters(), args.lr,
                                momentum=args.momentum,
                                weight_decay=args.weight_decay)
    
    """Sets the learning rate to the initial LR decayed by 10 every 30 epochs"""
    scheduler = StepLR(optimizer, step_size=30, gamma=0.1)
    
    # optionally resume from a checkpoint
    if args.resume:
        if os.path.isfile(args.resume):
            print("=> loading checkpoint '{}'".format(args.resume))
            checkpoint = torch.load(args.resume)
            args.start_epoch = checkpoint['epoch']
            best_acc1 = checkpoint['best_acc1']
            model.load_state_dict(checkpoint['state_dict'])
            optimizer.load_state_dict(checkpoint['optimizer'])
            scheduler.load_state_dict(checkpoint['scheduler'])
            print("=> loaded checkpoint '{}' (epoch {})"
                  .format(args.resume, checkpoint['epoch']))
        else:
            print("=> no checkpoint found at '{}'".format(args.resume))


    # Data loading code
    train_dataset = SyntheticImages('train', args.train_size)

    val_dataset = SyntheticImages('val', args.val_size)

    train_loader = hetlb.DataLoader(
        train_dataset, batch_size=args.batch_size,
        num_workers=args.workers, pin_memory=True)

    val_loader = hetlb.DataLoader(
        val_dataset, batch_size=args.batch_size, shuffle=False,
        num_workers=args.workers, pin_memory=True)
    hetlb.Balancer(model, loader=train_loader)
    if args.resume and os.path.isfile(args.resume):
        train_loader.load_state_dict(checkpoint['loader'])

    if args.evaluate:
        port_trace("val", f"val {args.start_epoch}")
        validate(val_loader, model, criterion, args)
        return

    for epoch in range(args.start_epoch, args.epochs):
        if args.distributed:
            train_loader.set_epoch(epoch)

        # train for one epoch
        port_trace("train", f"epoch {epoch}")
        train(train_loader, model, criterion, optimizer, epoch, device, args)

        # evaluate on validation set
        port_trace("val", f"val {epoch}")
        acc1 = validate(val_loader, model, criterion, args)
        port_trace("result", f"result epoch {epoch} acc1 {float(acc1):.6f} "
                   f"params {sum(p.double().sum().item() for p in model.parameters()):.9f} "
                   f"buffers {sum(b.double().sum().item() for b in model.buffers()):.9f}", echo=True)
        
        scheduler.step()
        
        # remember best acc@1 and save checkpoint
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)

        if not args.distributed or args.rank == 0:
            save_checkpoint({
                'epoch': epoch + 1,
                'arch': args.arch,
                'state_dict': model.state_dict(),
                'best_acc1': best_acc1,
                'optimizer' : optimizer.state_dict(),
                'loader': train_loader.state_dict(),
                'scheduler' : scheduler.state_dict()
            }, is_best, args.checkpoint)


def train(train_loader, model, criterion, optimizer, epoch, device, args):
    
    batch_time = AverageMeter('Time', ':6.3f', Summary.NONE)
    data_time = AverageMeter('Data', ':6.3f', Summary.NONE)
    losses = AverageMeter('Loss', ':.4e', Summary.NONE)
    top1 = AverageMeter('Acc@1', ':6.2f', Summary.NONE)
    top5 = AverageMeter('Acc@5', ':6.2f', Summary.NONE)
    progress = ProgressMeter(
        len(train_loader),
        [batch_time, data_time, losses, top1, top5],
        prefix="Epoch: [{}]".format(epoch))

    # switch to train mode
    model.train()

    end = time.time()
    for i, (images, target) in enumerate(train_loader):
        # measure data loading time
        data_time.update(time.time() - end)

        # move data to the same device as model
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)

        # compute output
        output = model(images)
        loss = criterion(output, target)

        # measure accuracy and record loss
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1[0], images.size(0))
        top5.update(acc5[0], images.size(0))

        # compute gradient and do SGD step
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        # measure elapsed time
        batch_time.update(time.time() - end)
        end = time.time()

        if i % args.print_freq == 0:
            progress.display(i + 1)


def validate(val_loader, model, criterion, args):

    def run_validate(loader, base_progress=0):

        with torch.no_grad():
            end = time.time()
            for i, (images, target) in enumerate(loader):
                i = base_progress + i

                # compute output
                output = model(images)
                loss = criterion(output, target)

                # measure accuracy and record loss
                acc1, acc5 = accuracy(output, target, topk=(1, 5))
                losses.update(loss.item(), images.size(0))
                top1.update(acc1[0], images.size(0))
                top5.update(acc5[0], images.size(0))

                # measure elapsed time
                batch_time.update(time.time() - end)
                end = time.time()

                if i % args.print_freq == 0:
                    progress.display(i + 1)

    batch_time = AverageMeter('Time', ':6.3f', Summary.NONE)
    losses = AverageMeter('Loss', ':.4e', Summary.NONE)
    top1 = AverageMeter('Acc@1', ':6.2f', Summary.AVERAGE)
    top5 = AverageMeter('Acc@5', ':6.2f', Summary.AVERAGE)
    progress = ProgressMeter(
        len(val_loader) + (args.distributed and (len(val_loader.sampler) * args.world_size < len(val_loader.dataset))),
        [batch_time, losses, top1, top5],
        prefix='Test: ')

    # switch to evaluate mode
    model.eval()

    run_validate(val_loader)
    if args.distributed:
        top1.all_reduce()
        top5.all_reduce()

    if args.distributed and (len(val_loader.sampler) * args.world_size < len(val_loader.dataset)):
        aux_val_dataset = Subset(val_loader.dataset,
                                 range(len(val_loader.sampler) * args.world_size, len(val_loader.dataset)))
        aux_val_loader = torch.utils.data.DataLoader(
            aux_val_dataset, batch_size=args.batch_size, shuffle=False,
            num_workers=args.workers, pin_memory=True)
        run_validate(aux_val_loader, len(val_loader))

    progress.display_summary()

    return top1.avg


def save_checkpoint(state, is_best, filename='checkpoint.pth.tar'):
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, 'model_best.pth.tar')

class Summary(Enum):
    NONE = 0
    AVERAGE = 1
    SUM = 2
    COUNT = 3

class AverageMeter(object):
    """Computes and stores the average and current value"""
    def __init__(self, name, fmt=':f', summary_type=Summary.AVERAGE):
        self.name = name
        self.fmt = fmt
        self.summary_type = summary_type
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def all_reduce(self):    
        device = torch.device("cpu")
        total = torch.tensor([self.sum, self.count], dtype=torch.float32, device=device)
        dist.all_reduce(total, dist.ReduceOp.SUM, async_op=False)
        self.sum, self.count = total.tolist()
        self.avg = self.sum / self.count

    def __str__(self):
        fmtstr = '{name} {val' + self.fmt + '} ({avg' + self.fmt + '})'
        return fmtstr.format(**self.__dict__)
    
    def summary(self):
        fmtstr = ''
        if self.summary_type is Summary.NONE:
            fmtstr = ''
        elif self.summary_type is Summary.AVERAGE:
            fmtstr = '{name} {avg:.3f}'
        elif self.summary_type is Summary.SUM:
            fmtstr = '{name} {sum:.3f}'
        elif self.summary_type is Summary.COUNT:
            fmtstr = '{name} {count:.3f}'
        else:
            raise ValueError('invalid summary type %r' % self.summary_type)
        
        return fmtstr.format(**self.__dict__)


class ProgressMeter(object):
    def __init__(self, num_batches, meters, prefix=""):
        self.batch_fmtstr = self._get_batch_fmtstr(num_batches)
        self.meters = meters
        self.prefix = prefix

    def display(self, batch):
        entries = [self.prefix + self.batch_fmtstr.format(batch)]
        entries += [str(meter) for meter in self.meters]
        print('\t'.join(entries))
        
    def display_summary(self):
        entries = [" *"]
        entries += [meter.summary() for meter in self.meters]
        print(' '.join(entries))

    def _get_batch_fmtstr(self, num_batches):
        num_digits = len(str(num_batches // 1))
        fmt = '{:' + str(num_digits) + 'd}'
        return '[' + fmt + '/' + fmt.format(num_batches) + ']'

def accuracy(output, target, topk=(1,)):
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)

        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))

        res = []
        for k in topk:
            correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
            res.append(correct_k.mul_(100.0 / max(batch_size, 1)))
        return res


if __name__ == '__main__':
    main()
