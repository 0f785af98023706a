//! The `train_tiny` example's logic: weights identical on every rank and close to the truth.

#[path = "../examples/train_tiny.rs"]
mod train_tiny;

use fh_scheduler::{Config, Preset};

#[test]
fn data_parallel_training_converges_with_identical_weights() {
    for cfg in [
        Config::preset(Preset::FastHorovod).channels(2),
        Config::preset(Preset::Horovod),
    ] {
        let results = train_tiny::train(3, 150, cfg);
        let results: Vec<_> = results
            .into_iter()
            .map(|r| r.expect("rank trains"))
            .collect();
        let (w0, first, last) = &results[0];
        for (w, _, _) in &results {
            assert_eq!(w, w0, "weights differ between ranks");
        }
        assert!(last < &(first / 100.0), "loss {first} -> {last}");
        let (tw, tb) = train_tiny::true_weights();
        for (a, b) in w0.iter().zip(tw.iter().chain([&tb])) {
            assert!((a - b).abs() < 0.05, "{w0:?} vs {tw:?} + {tb}");
        }
    }
}
