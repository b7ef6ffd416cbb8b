//! A join loop against fake trackers speaking the control protocol: one that never acks usage
//! reports holds at most a window of them and loses them all to another tracker once its Ack
//! deadline passes; one that refuses a report keeps the connection and gets it again later.

use super::*;
use dgr_proto::{codec, key_id, Ack, Challenge, Joined, Refused, TrackerKey, PROTOCOL_VERSION, TRACKER_MAX_FRAME};
use std::collections::HashSet;
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio_util::codec::{Framed, LengthDelimitedCodec};

const HEARTBEAT_MS: u32 = 50;
const DEADLINE: Duration = Duration::from_secs(10);

type Conn = Framed<dgr_proto::SecureStream, LengthDelimitedCodec>;

fn report(i: usize) -> WorkerUsage {
    WorkerUsage { session_id: format!("s{i}").into_bytes(), request_id: format!("r{i}"), layer_tokens: 1, ..Default::default() }
}

/// An outbox holding reports `0..n`.
fn outbox(n: usize) -> Arc<UsageOutbox> {
    let o = UsageOutbox::new(Arc::new(Metrics::default()));
    o.queue().extend((0..n).map(report));
    o
}

fn joiner(tracker: &str, outbox: &Arc<UsageOutbox>, leave: &watch::Receiver<bool>) -> Joiner {
    let identity = dgr_proto::SigningKey::from_bytes(&[3; 32]);
    Joiner {
        tracker: tracker.into(),
        link: TrackerLink {
            addrs: vec![tracker.into()],
            join_token: "token".into(),
            identity,
            advertise: None,
            join_timeout: Duration::from_secs(60),
        },
        reg: Registration::default(),
        gate: Arc::new(TicketGate::new("w".into())),
        metrics: Arc::new(Metrics::default()),
        outbox: outbox.clone(),
        leave: leave.clone(),
        joined: Arc::new(watch::channel(false).0),
    }
}

async fn send(c: &mut Conn, body: TrackerBody) {
    c.send(Bytes::from(TrackerFrame::new(body).encode_to_vec())).await.unwrap();
}

/// The worker's next frame other than a heartbeat (within DEADLINE); None once it closed the
/// connection.
async fn next(c: &mut Conn) -> Option<TrackerBody> {
    let until = Instant::now() + DEADLINE;
    loop {
        let frame = tokio::time::timeout_at(until, c.next()).await.expect("nothing but heartbeats from the worker");
        match TrackerFrame::decode(frame?.ok()?).unwrap().body {
            Some(TrackerBody::Heartbeat(_)) => continue,
            body => return body,
        }
    }
}

/// Accepts one control connection and answers its secure channel, hello and join, as a tracker
/// does.
async fn accept_join(l: &TcpListener) -> Conn {
    let (mut s, _) = tokio::time::timeout(DEADLINE, l.accept()).await.expect("no join").unwrap();
    let signing = dgr_proto::SigningKey::from_bytes(&[7; 32]);
    let mut head = [0u8; 4];
    s.read_exact(&mut head).await.unwrap();
    let link = dgr_proto::respond_as(&dgr_proto::Identity::new(&signing).unwrap(), head, s, DEADLINE).await.unwrap();
    let mut c = Framed::new(link, codec(TRACKER_MAX_FRAME));
    assert!(matches!(next(&mut c).await, Some(TrackerBody::Hello(_))));
    let key = signing.verifying_key();
    let keys = vec![TrackerKey { key_id: key_id(&key), public_key: key.to_bytes().to_vec() }];
    send(&mut c, TrackerBody::Challenge(Challenge { protocol_version: PROTOCOL_VERSION, nonce: vec![1; 32], keys })).await;
    assert!(matches!(next(&mut c).await, Some(TrackerBody::Join(_))));
    send(&mut c, TrackerBody::Joined(Joined { worker_id: "w".into(), heartbeat_ms: HEARTBEAT_MS })).await;
    c
}

async fn listen() -> (TcpListener, String) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (l, addr)
}

#[tokio::test]
async fn a_tracker_that_never_acks_holds_one_window_and_loses_its_reports_to_another() {
    const REPORTS: usize = IN_FLIGHT + 44;
    let out = outbox(REPORTS);
    let (_leave, leave) = watch::channel(false);
    let (hung, hung_addr) = listen().await;
    tokio::spawn(joiner(&hung_addr, &out, &leave).run(|_| {}));
    let mut c = accept_join(&hung).await;
    // Refused from now on: the worker cannot re-join the hung tracker.
    drop(hung);
    let started = Instant::now();
    let mut got = 0;
    while let Some(body) = next(&mut c).await {
        assert!(matches!(body, TrackerBody::WorkerUsage(_)), "{body:?}");
        got += 1;
    }
    let waited = started.elapsed();
    assert_eq!(got, IN_FLIGHT, "one connection holds at most a window of unacknowledged reports");
    let deadline = ACK_HEARTBEATS * Duration::from_millis(HEARTBEAT_MS.into());
    assert!(waited >= deadline, "gave up after {waited:?}, before the Ack deadline");

    // Every report, the window included, reaches a tracker that acks.
    let (good, good_addr) = listen().await;
    tokio::spawn(joiner(&good_addr, &out, &leave).run(|_| {}));
    let mut c = accept_join(&good).await;
    let mut stored = HashSet::new();
    while stored.len() < REPORTS {
        match next(&mut c).await {
            Some(TrackerBody::WorkerUsage(u)) => {
                stored.insert(u.request_id);
                send(&mut c, TrackerBody::Ack(Ack { duplicate: false })).await;
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(out.queue().is_empty());
}

#[tokio::test]
async fn a_refused_report_keeps_the_connection_and_is_sent_again_a_heartbeat_later() {
    let out = outbox(1);
    let (_leave, leave) = watch::channel(false);
    let (l, addr) = listen().await;
    tokio::spawn(joiner(&addr, &out, &leave).run(|_| {}));
    let mut c = accept_join(&l).await;
    let Some(TrackerBody::WorkerUsage(first)) = next(&mut c).await else { panic!("no report") };
    send(&mut c, TrackerBody::Refused(Refused::new(RefusalKind::Unavailable, "the ledger is down"))).await;
    let refused = Instant::now();
    let Some(TrackerBody::WorkerUsage(again)) = next(&mut c).await else { panic!("the report was not sent again") };
    assert_eq!(again, first);
    let waited = refused.elapsed();
    assert!(waited >= Duration::from_millis(HEARTBEAT_MS.into()), "sent again after {waited:?}, within a heartbeat");
    send(&mut c, TrackerBody::Ack(Ack { duplicate: false })).await;
    // Still joined on the same connection: heartbeats keep coming and no re-join arrives.
    let beat = tokio::time::timeout(DEADLINE, c.next()).await.unwrap().unwrap().unwrap();
    assert!(matches!(TrackerFrame::decode(beat).unwrap().body, Some(TrackerBody::Heartbeat(_))));
    let rejoin = tokio::time::timeout(Duration::from_millis(4 * u64::from(HEARTBEAT_MS)), l.accept()).await;
    assert!(rejoin.is_err(), "the worker re-joined after a refused report");
    assert!(out.queue().is_empty());
}
