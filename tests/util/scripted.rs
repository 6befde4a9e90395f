//! A stand-in server that answers every request as a test says, and keeps
//! the exact bytes of each frame it read: for what a client puts on the
//! wire, and for answers a real server would not give in that state.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kunci::protocol::{Decoded, Request, Response, decode_request, encode_response};

type Answer = dyn Fn(&Request<'_>) -> Vec<Response> + Send + Sync;

pub struct Scripted {
    pub addr: String,
    frames: Arc<Mutex<Vec<Vec<u8>>>>,
    accepted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl Scripted {
    /// Listens on a free loopback port; each request gets the frames
    /// `answer` returns for it, in order.
    pub fn start(
        answer: impl Fn(&Request<'_>) -> Vec<Response> + Send + Sync + 'static,
    ) -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let frames = Arc::new(Mutex::new(Vec::new()));
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let answer: Arc<Answer> = Arc::new(answer);
        {
            let (frames, accepted, stop) = (frames.clone(), accepted.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((stream, _)) => {
                            accepted.fetch_add(1, Ordering::Relaxed);
                            let (frames, answer, stop) =
                                (frames.clone(), answer.clone(), stop.clone());
                            std::thread::spawn(move || serve(stream, &frames, &*answer, &stop));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(2)),
                    }
                }
            });
        }
        Scripted {
            addr,
            frames,
            accepted,
            stop,
        }
    }

    /// Every request frame read so far, byte for byte, in arrival order.
    pub fn frames(&self) -> Vec<Vec<u8>> {
        self.frames.lock().unwrap().clone()
    }

    /// How many connections were accepted.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for Scripted {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn serve(mut stream: TcpStream, frames: &Mutex<Vec<Vec<u8>>>, answer: &Answer, stop: &AtomicBool) {
    stream
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    while !stop.load(Ordering::Relaxed) {
        match stream.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue;
            }
            Err(_) => return,
        }
        let mut out = Vec::new();
        loop {
            let (responses, len) = match decode_request(&buffer) {
                Decoded::Incomplete => break,
                Decoded::Request { request, len } => (answer(&request), len),
                Decoded::Invalid { error, len } => (vec![error.response()], len),
                Decoded::Fatal(error) => (vec![error.response()], buffer.len()),
            };
            frames.lock().unwrap().push(buffer[..len].to_vec());
            buffer.drain(..len);
            for response in responses {
                encode_response(&response, &mut out);
            }
        }
        if stream.write_all(&out).is_err() {
            return;
        }
    }
}
