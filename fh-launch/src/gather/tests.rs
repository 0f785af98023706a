use std::os::unix::fs::MetadataExt;

use std::path::{Path, PathBuf};

use super::{plain_name, relay, Gather, PartDir, DIRS, MAX_FILE};

/// A fresh directory, removed at the end.
struct Tmp(PathBuf);

impl Tmp {
    fn new() -> Tmp {
        let tag = crate::sys::random_hex(6).unwrap();
        let p = std::env::temp_dir().join(format!("fh-gather-test-{tag}"));
        std::fs::create_dir(&p).unwrap();
        Tmp(p)
    }
}

impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const M: &str = "fhrun-files-0123";

fn gather_into(dest: &Path) -> Gather {
    for d in DIRS {
        let _ = std::fs::create_dir(dest.join(d));
    }
    Gather {
        marker: M.into(),
        dirs: DIRS.iter().map(|d| (d.to_string(), dest.join(d))).collect(),
    }
}

/// Relays `stream`; returns what was passed on as output.
fn relay_text(stream: &[u8], g: &Gather) -> String {
    let mut out = Vec::new();
    relay(stream, &mut out, g, "ranks 2-3 on far");
    String::from_utf8(out).unwrap()
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[test]
fn a_part_files_travel_whole_and_the_output_is_left_as_it_was() {
    let part = PartDir::create(&["flight".into(), "timeline".into()]).unwrap();
    let root = part.path.clone();
    assert_eq!(
        std::fs::metadata(&root).unwrap().mode() & 0o777,
        0o700,
        "{root:?}"
    );
    let big: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(part.dir("flight").unwrap().join("rank-2.json"), &big).unwrap();
    std::fs::write(part.dir("flight").unwrap().join("rank-3.json"), b"").unwrap();
    // A record being written (a temporary name) stays behind.
    std::fs::write(part.dir("flight").unwrap().join(".rank-3.json.9.tmp"), b"x").unwrap();
    std::fs::write(part.dir("timeline").unwrap().join("rank-2.json"), b"[1]").unwrap();
    let mut stream = b"[2]<stdout>:hello\n".to_vec();
    part.send_and_remove(M, &mut stream, "test part");
    stream.extend_from_slice(b"[3]<stdout>:bye\n");
    assert!(!root.exists(), "the part's directory is removed once sent");

    let dest = Tmp::new();
    let g = gather_into(&dest.0);
    assert_eq!(
        relay_text(&stream, &g),
        "[2]<stdout>:hello\n[3]<stdout>:bye\n"
    );
    assert_eq!(
        std::fs::read(dest.0.join("flight/rank-2.json")).unwrap(),
        big
    );
    assert_eq!(
        std::fs::read(dest.0.join("flight/rank-3.json")).unwrap(),
        b""
    );
    assert_eq!(
        names(&dest.0.join("flight")),
        ["rank-2.json", "rank-3.json"]
    );
    assert_eq!(
        std::fs::read(dest.0.join("timeline/rank-2.json")).unwrap(),
        b"[1]"
    );
}

#[test]
fn while_the_job_runs_only_new_or_changed_flight_records_travel() {
    let mut part = PartDir::create(&["flight".into(), "timeline".into()]).unwrap();
    let root = part.path.clone();
    let flight = part.dir("flight").unwrap().to_path_buf();
    std::fs::create_dir(flight.join("gen-0")).unwrap();
    std::fs::write(flight.join("gen-0/rank-2.json"), b"first").unwrap();
    std::fs::write(flight.join("rank-3.json"), b"three").unwrap();
    std::fs::write(part.dir("timeline").unwrap().join("rank-2.json"), b"[1]").unwrap();
    let sends = |part: &mut PartDir| {
        let mut out = Vec::new();
        part.send_while_running(M, &mut out, "test part");
        String::from_utf8(out).unwrap()
    };
    // The flight records, not the timelines (they travel at the end), then `sent`.
    let first = sends(&mut part);
    let begins: Vec<&str> = first.lines().filter(|l| l.contains(" begin ")).collect();
    assert_eq!(
        begins,
        [
            format!("{M} begin flight gen-0/rank-2.json 5"),
            format!("{M} begin flight rank-3.json 5")
        ]
    );
    assert!(first.ends_with(&format!("{M} sent\n")), "{first}");
    // Nothing new: nothing sent, not even `sent`.
    assert_eq!(sends(&mut part), "");
    // A record written again (a new file renamed over it, as the runtime does) travels again.
    std::fs::write(flight.join(".new"), b"second!").unwrap();
    std::fs::rename(flight.join(".new"), flight.join("gen-0/rank-2.json")).unwrap();
    let again = sends(&mut part);
    assert!(
        again.starts_with(&format!("{M} begin flight gen-0/rank-2.json 7\n")),
        "{again}"
    );
    assert_eq!(again.matches(" begin ").count(), 1, "{again}");

    // fhrun says where they are on `sent`, and keeps the latest of each.
    let dest = Tmp::new();
    let g = gather_into(&dest.0);
    let mut stream = format!("{first}{again}").into_bytes();
    // At the end, only the timeline is new.
    let mut last = Vec::new();
    part.send_and_remove(M, &mut last, "test part");
    assert_eq!(String::from_utf8_lossy(&last).matches(" begin ").count(), 1);
    assert!(!root.exists());
    stream.extend_from_slice(&last);
    assert_eq!(relay_text(&stream, &g), "");
    assert_eq!(
        std::fs::read(dest.0.join("flight/gen-0/rank-2.json")).unwrap(),
        b"second!"
    );
    assert_eq!(
        std::fs::read(dest.0.join("flight/rank-3.json")).unwrap(),
        b"three"
    );
    assert_eq!(
        std::fs::read(dest.0.join("timeline/rank-2.json")).unwrap(),
        b"[1]"
    );
}

#[test]
fn files_of_subdirectories_travel_into_directories_made_for_them() {
    // An elastic part's generations and a process set's records, one level down.
    let part = PartDir::create(&["flight".into(), "timeline".into()]).unwrap();
    let flight = part.dir("flight").unwrap().to_path_buf();
    for sub in ["gen-0", "gen-1", "set-0.1", "gen-1/set-0.1"] {
        std::fs::create_dir(flight.join(sub)).unwrap();
    }
    std::fs::write(flight.join("gen-0/rank-1.json"), b"g0").unwrap();
    std::fs::write(flight.join("gen-1/set-0.1/rank-1.json"), b"g1s").unwrap();
    std::fs::write(flight.join("gen-1/rank-0.json"), b"g1").unwrap();
    std::fs::write(flight.join("set-0.1/rank-1.json"), b"s").unwrap();
    let mut stream = Vec::new();
    part.send_and_remove(M, &mut stream, "test part");
    // fhrun's side has no flight directory yet (none of its own ranks wrote a record).
    let dest = Tmp::new();
    let g = gather_into(&dest.0);
    std::fs::remove_dir(dest.0.join("flight")).unwrap();
    assert_eq!(relay_text(&stream, &g), "");
    assert_eq!(names(&dest.0.join("flight")), ["gen-0", "gen-1", "set-0.1"]);
    for (file, want) in [
        ("gen-0/rank-1.json", &b"g0"[..]),
        ("gen-1/rank-0.json", b"g1"),
        ("gen-1/set-0.1/rank-1.json", b"g1s"),
        ("set-0.1/rank-1.json", b"s"),
    ] {
        assert_eq!(
            std::fs::read(dest.0.join("flight").join(file)).unwrap(),
            want
        );
    }
    let mode = std::fs::metadata(dest.0.join("flight/gen-0"))
        .unwrap()
        .mode();
    assert_eq!(mode & 0o777, 0o700);
}

#[test]
fn what_lies_too_deep_stays_named() {
    let part = PartDir::create(&["flight".into()]).unwrap();
    let root = part.path.clone();
    let deep = part.dir("flight").unwrap().join("a/b/c");
    std::fs::create_dir_all(&deep).unwrap();
    std::fs::write(deep.join("rank-0.json"), b"x").unwrap();
    let mut stream = Vec::new();
    part.send_and_remove(M, &mut stream, "test part");
    assert!(stream.is_empty(), "{}", String::from_utf8_lossy(&stream));
    assert!(root.exists(), "kept: it holds what was not sent");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_symlink_is_not_sent_and_what_was_not_sent_stays() {
    let part = PartDir::create(&["flight".into()]).unwrap();
    let root = part.path.clone();
    let secret = Tmp::new();
    std::fs::write(secret.0.join("secret"), b"do not send").unwrap();
    std::os::unix::fs::symlink(
        secret.0.join("secret"),
        part.dir("flight").unwrap().join("rank-0.json"),
    )
    .unwrap();
    let mut stream = Vec::new();
    part.send_and_remove(M, &mut stream, "test part");
    assert!(stream.is_empty(), "{}", String::from_utf8_lossy(&stream));
    assert!(root.exists());
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn names_that_leave_the_directory_and_unknown_directories_are_refused() {
    let dest = Tmp::new();
    let g = gather_into(&dest.0);
    let mut stream = String::new();
    for (dir, name) in [
        ("flight", "../escape.json"),
        ("flight", "a/b/c/d.json"),
        ("flight", "a/../b.json"),
        ("flight", "./b.json"),
        ("flight", ".."),
        ("flight", ".hidden"),
        ("elsewhere", "rank-0.json"),
        ("..", "rank-0.json"),
    ] {
        stream += &format!("{M} begin {dir} {name} 2\n{M} data eHg=\n{M} end\n");
    }
    // Too big, and more bytes than announced.
    stream += &format!("{M} begin flight rank-1.json {}\n{M} end\n", MAX_FILE + 1);
    stream += &format!("{M} begin flight rank-2.json 1\n{M} data eHg=\n{M} end\n");
    assert_eq!(relay_text(stream.as_bytes(), &g), "");
    assert_eq!(names(&dest.0), ["flight", "timeline"]);
    assert!(names(&dest.0.join("flight")).is_empty());
    assert!(!dest.0.join("escape.json").exists());
    assert!(!dest.0.join("flight/a").exists());
}

#[test]
fn a_file_cut_short_is_not_kept() {
    let dest = Tmp::new();
    let g = gather_into(&dest.0);
    let stream = format!("{M} begin flight rank-0.json 4\n{M} data eHg=\n");
    assert_eq!(relay_text(stream.as_bytes(), &g), "");
    assert!(names(&dest.0.join("flight")).is_empty());
    let stream = format!("{M} begin flight rank-0.json 4\n{M} data eHg=\n{M} end\n");
    relay_text(stream.as_bytes(), &g);
    assert!(names(&dest.0.join("flight")).is_empty());
}

#[test]
fn a_file_line_after_an_unfinished_output_line_is_still_taken() {
    let dest = Tmp::new();
    let g = gather_into(&dest.0);
    let stream = format!("no newline{M} begin flight rank-0.json 2\n{M} data eHg=\n{M} end\nok\n");
    assert_eq!(relay_text(stream.as_bytes(), &g), "no newline\nok\n");
    assert_eq!(
        std::fs::read(dest.0.join("flight/rank-0.json")).unwrap(),
        b"xx"
    );
}

#[test]
fn an_identical_file_is_left_alone_and_a_symlink_is_replaced_not_followed() {
    let dest = Tmp::new();
    let g = gather_into(&dest.0);
    let target = dest.0.join("flight/rank-0.json");
    std::fs::write(&target, b"xx").unwrap();
    let inode = std::fs::metadata(&target).unwrap().ino();
    let stream = format!("{M} begin flight rank-0.json 2\n{M} data eHg=\n{M} end\n");
    relay_text(stream.as_bytes(), &g);
    assert_eq!(std::fs::metadata(&target).unwrap().ino(), inode);
    assert_eq!(names(&dest.0.join("flight")), ["rank-0.json"]);

    let other = Tmp::new();
    std::fs::write(other.0.join("victim"), b"keep").unwrap();
    std::fs::remove_file(&target).unwrap();
    std::os::unix::fs::symlink(other.0.join("victim"), &target).unwrap();
    relay_text(stream.as_bytes(), &g);
    assert_eq!(std::fs::read(other.0.join("victim")).unwrap(), b"keep");
    assert!(std::fs::symlink_metadata(&target).unwrap().is_file());
    assert_eq!(std::fs::read(&target).unwrap(), b"xx");
}

#[test]
fn plain_names() {
    for ok in ["rank-0.json", "a_b.c"] {
        assert!(plain_name(ok), "{ok}");
    }
    for bad in [
        "",
        ".",
        "..",
        "../x",
        "a/b",
        ".x",
        "a b",
        "a\nb",
        &"x".repeat(201),
    ] {
        assert!(!plain_name(bad), "{bad:?}");
    }
}
