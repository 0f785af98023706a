//! The two fusion rule sets: Horovod 0.28's greedy front-to-back fusion, and FastHorovod's
//! per-key open groups with large tensors split over the channels.

use super::{chunk_count, FusionKey, Group, Part, PlanItem, PlanOptions};

fn whole(i: usize, it: &PlanItem) -> Part {
    Part {
        item: i,
        offset: 0,
        len: it.bytes,
    }
}

pub(super) fn plan_horovod(items: &[PlanItem], order: &[usize], threshold: u64) -> Vec<Group> {
    let mut queue: std::collections::VecDeque<usize> = order.iter().copied().collect();
    let mut groups = Vec::new();
    while let Some(first) = queue.pop_front() {
        let head = &items[first];
        let mut parts = vec![whole(first, head)];
        if head.fusable() {
            let mut size = head.bytes;
            let mut skipped = Vec::new();
            let mut skipped_size = 0u64;
            while let Some(&next) = queue.front() {
                let it = &items[next];
                if it.key == head.key && size.saturating_add(it.bytes) <= threshold {
                    size += it.bytes;
                    parts.push(whole(next, it));
                    queue.pop_front();
                } else {
                    // Look past a non-matching response only while the skipped bytes would
                    // still fit under the threshold.
                    skipped_size = skipped_size.saturating_add(it.bytes);
                    if size.saturating_add(skipped_size) <= threshold {
                        skipped.push(next);
                        queue.pop_front();
                    } else {
                        break;
                    }
                }
            }
            for s in skipped.into_iter().rev() {
                queue.push_front(s);
            }
        }
        groups.push(Group { channel: 0, parts });
    }
    groups
}

pub(super) fn plan_fast(
    items: &[PlanItem],
    order: &[usize],
    opts: &PlanOptions,
    channels: usize,
    eligible: usize,
) -> Vec<Group> {
    // With several eligible channels, cap groups near an equal share of the round so that each
    // of them gets work, but never above the threshold nor below 64 KiB (tiny groups cost
    // latency). The share counts only the bytes that go into fused groups: a tensor split into
    // chunks already spreads over every channel, and counting it made the rest one group on
    // one channel (BERT-base's last round: its 94 MB embedding in chunks over both channels,
    // then its other 17 gradients, 30 MB, as one group that ran alone on one channel for
    // ~60 ms while the other idled).
    let partition = opts.partition_bytes.max(1);
    let total: u64 = order
        .iter()
        .map(|&i| &items[i])
        .filter(|it| !(it.fusable() && it.bytes > partition))
        .map(|it| it.bytes)
        .sum();
    let cap = if eligible > 1 {
        opts.fusion_threshold
            .min(total.div_ceil(eligible as u64).max(64 * 1024))
    } else {
        opts.fusion_threshold
    };
    let mut groups: Vec<Group> = Vec::new();
    let mut open: Vec<(FusionKey, usize, u64)> = Vec::new(); // key, group index, bytes
    let mut done = vec![false; items.len()];
    for &i in order {
        if done[i] {
            continue;
        }
        let it = &items[i];
        if let Some(gid) = it.group {
            // A grouped submission: all its members in one group of their own, if they can.
            let members: Vec<usize> = order
                .iter()
                .copied()
                .filter(|&j| items[j].group == Some(gid))
                .collect();
            let bytes: u64 = members.iter().map(|&j| items[j].bytes).sum();
            if it.fusable()
                && members.iter().all(|&j| items[j].key == it.key)
                && bytes <= opts.fusion_threshold
            {
                open.retain(|(k, _, _)| *k != it.key);
                groups.push(Group {
                    channel: 0,
                    parts: members.iter().map(|&j| whole(j, &items[j])).collect(),
                });
                for j in members {
                    done[j] = true;
                }
                continue;
            }
        }
        if it.fusable() && it.bytes > partition {
            // Later tensors of this key must not join a group placed before these chunks.
            open.retain(|(k, _, _)| *k != it.key);
            // Equal chunks (element-aligned; the first ones one element longer when it does
            // not divide), a multiple of the channel count.
            let elem = it.elem.max(1);
            let elems = it.bytes / elem;
            let n = chunk_count(it.bytes, elem, partition, channels);
            let (base, extra) = (elems / n, elems % n);
            let mut off = 0;
            for c in 0..n {
                let len = (base + u64::from(c < extra)) * elem;
                groups.push(Group {
                    channel: 0,
                    parts: vec![Part {
                        item: i,
                        offset: off,
                        len,
                    }],
                });
                off += len;
            }
            continue;
        }
        if !it.fusable() {
            groups.push(Group {
                channel: 0,
                parts: vec![whole(i, it)],
            });
            continue;
        }
        match open.iter_mut().find(|(k, _, _)| *k == it.key) {
            Some((_, g, bytes)) if bytes.saturating_add(it.bytes) <= cap => {
                groups[*g].parts.push(whole(i, it));
                *bytes += it.bytes;
            }
            slot => {
                groups.push(Group {
                    channel: 0,
                    parts: vec![whole(i, it)],
                });
                let g = groups.len() - 1;
                match slot {
                    Some(s) => *s = (it.key, g, it.bytes),
                    None => open.push((it.key, g, it.bytes)),
                }
            }
        }
    }
    groups
}
