package kunci

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// The tests drive a real `kunci serve`: $KUNCI_BIN, else the repository's
// target/release/kunci (cargo build --release). A missing binary fails
// the test, never skips it.
func kunciBin(t *testing.T) string {
	t.Helper()
	path := os.Getenv("KUNCI_BIN")
	if path == "" {
		path, _ = filepath.Abs(filepath.Join("..", "..", "target", "release", "kunci"))
	}
	if info, err := os.Stat(path); err != nil || info.Mode()&0o111 == 0 {
		t.Fatalf("no kunci binary at %s: run `cargo build --release` or set KUNCI_BIN", path)
	}
	return path
}

var listening = regexp.MustCompile(`listening on (\S+(?: \S+)*?); limits`)

type server struct {
	cmd       *exec.Cmd
	addresses []string
	address   string
	port      string
	log       *strings.Builder
	logMu     sync.Mutex
	done      chan struct{}
}

// startServer starts `kunci serve` on a free loopback port (or the given
// --listen addresses), its state in a temporary directory; it is stopped
// when the test ends.
func startServer(t *testing.T, args ...string) *server {
	t.Helper()
	hasListen, hasStateDir := false, false
	for _, a := range args {
		hasListen = hasListen || a == "--listen"
		hasStateDir = hasStateDir || a == "--state-dir"
	}
	full := []string{"serve"}
	if !hasStateDir {
		full = append(full, "--state-dir", t.TempDir())
	}
	if !hasListen {
		full = append(full, "--listen", "127.0.0.1:0")
	}
	full = append(full, args...)
	cmd := exec.Command(kunciBin(t), full...)
	cmd.Env = append(os.Environ(), "RUST_LOG=info")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	s := &server{cmd: cmd, log: &strings.Builder{}, done: make(chan struct{})}
	found := make(chan []string, 1)
	go func() {
		reader := bufio.NewReader(stderr)
		sent := false
		for {
			line, err := reader.ReadString('\n')
			s.logMu.Lock()
			s.log.WriteString(line)
			s.logMu.Unlock()
			if m := listening.FindStringSubmatch(line); m != nil && !sent {
				found <- strings.Split(m[1], " ")
				sent = true
			}
			if err != nil {
				close(s.done)
				if !sent {
					close(found)
				}
				return
			}
		}
	}()
	select {
	case addrs, ok := <-found:
		if !ok {
			_ = cmd.Wait()
			t.Fatalf("kunci serve exited: %s", s.logText())
		}
		s.addresses = addrs
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		t.Fatal("kunci serve did not start")
	}
	s.address = s.addresses[0]
	if i := strings.LastIndexByte(s.address, ':'); i >= 0 {
		s.port = s.address[i+1:]
	}
	t.Cleanup(s.stop)
	return s
}

func (s *server) logText() string {
	s.logMu.Lock()
	defer s.logMu.Unlock()
	return s.log.String()
}

// crash ends the server with SIGKILL (an unclean stop).
func (s *server) crash() {
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
}

// stop ends the server with SIGTERM (a clean stop).
func (s *server) stop() {
	if s.cmd.ProcessState != nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	exited := make(chan struct{})
	go func() { _ = s.cmd.Wait(); close(exited) }()
	select {
	case <-exited:
	case <-time.After(5 * time.Second):
		_ = s.cmd.Process.Kill()
		<-exited
	}
}

func dial(t *testing.T, addr string, opts ...Option) *Client {
	t.Helper()
	c, err := Dial(addr, opts...)
	if err != nil {
		t.Fatalf("Dial(%q): %v", addr, err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func bg() context.Context { return context.Background() }

func mustInfo(t *testing.T, c *Client, name string) string {
	t.Helper()
	info, err := c.Info(bg())
	if err != nil {
		t.Fatalf("info: %v", err)
	}
	return info[name]
}

// waitFor polls cond every 5 ms until it holds, failing after limit.
func waitFor(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// proxy is a TCP proxy in front of a server that injects faults. Its
// settings are read at each step, so a test may change them while
// connections run.
type proxy struct {
	listener net.Listener
	upstream string
	address  string
	// dropDown: answers from the server are swallowed.
	dropDown atomic.Bool
	// dropDownNew: connections accepted while it is set swallow every
	// answer for their whole life.
	dropDownNew atomic.Bool
	// dropUp: requests from the client are swallowed.
	dropUp atomic.Bool
	// downDelay: each server→client chunk is held back this long (ns).
	downDelay atomic.Int64
	// accept: "forward"; "x7"/"x9" (that X as the first frame, then close).
	acceptMode atomic.Value
	accepted   atomic.Int64
	mu         sync.Mutex
	up         []byte   // every byte clients sent
	ups        [][]byte // what each connection's client sent, in accept order
	conns      []net.Conn
}

func newProxy(t *testing.T, upstream string) *proxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{listener: l, upstream: upstream, address: l.Addr().String()}
	p.acceptMode.Store("forward")
	go p.acceptLoop()
	t.Cleanup(p.close)
	return p
}

func (p *proxy) close() {
	_ = p.listener.Close()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		_ = c.Close()
	}
}

// cut closes every connection through the proxy.
func (p *proxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.conns = nil
}

func (p *proxy) upBytes() []byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]byte(nil), p.up...)
}

func (p *proxy) connUp(i int) []byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]byte(nil), p.ups[i]...)
}

func (p *proxy) acceptLoop() {
	for {
		client, err := p.listener.Accept()
		if err != nil {
			return
		}
		p.accepted.Add(1)
		p.mu.Lock()
		p.conns = append(p.conns, client)
		p.ups = append(p.ups, nil)
		index := len(p.ups) - 1
		p.mu.Unlock()
		go p.serve(client, index, p.dropDownNew.Load())
	}
}

func (p *proxy) serve(client net.Conn, index int, dropAll bool) {
	switch mode := p.acceptMode.Load().(string); mode {
	case "x7", "x9":
		code := byte(7)
		if mode == "x9" {
			code = 9
		}
		frame := append([]byte{'X', code, 0, 0, 0, 0, 0, 0, 0, 0}, []byte("refused\n")...)
		_, _ = client.Write(frame)
		_ = client.(*net.TCPConn).CloseWrite()
		_ = client.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		p.record(client, index)
		_ = client.Close()
		return
	}
	server, err := net.Dial("tcp", p.upstream)
	if err != nil {
		_ = client.Close()
		return
	}
	p.mu.Lock()
	p.conns = append(p.conns, server)
	p.mu.Unlock()
	go func() {
		buf := make([]byte, 65536)
		for {
			n, err := client.Read(buf)
			if n > 0 {
				p.mu.Lock()
				p.up = append(p.up, buf[:n]...)
				p.ups[index] = append(p.ups[index], buf[:n]...)
				p.mu.Unlock()
				if !p.dropUp.Load() {
					if _, err := server.Write(buf[:n]); err != nil {
						break
					}
				}
			}
			if err != nil {
				break
			}
		}
		_ = client.Close()
		_ = server.Close()
	}()
	buf := make([]byte, 65536)
	for {
		n, err := server.Read(buf)
		if n > 0 {
			if d := p.downDelay.Load(); d > 0 {
				time.Sleep(time.Duration(d))
			}
			if !p.dropDown.Load() && !dropAll {
				if _, err := client.Write(buf[:n]); err != nil {
					break
				}
			}
		}
		if err != nil {
			break
		}
	}
	_ = client.Close()
	_ = server.Close()
}

func (p *proxy) record(c net.Conn, index int) {
	data, _ := io.ReadAll(c)
	p.mu.Lock()
	p.up = append(p.up, data...)
	p.ups[index] = append(p.ups[index], data...)
	p.mu.Unlock()
}

// deadAddress is a loopback address where nothing listens, for the whole
// test: its port stays bound (without listening), so that no server of
// a test running in parallel can take it.
func deadAddress(t *testing.T) string {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("127.0.0.1:%d", sa.(*syscall.SockaddrInet4).Port)
}

// fakeServer answers each connection with respond(request bytes): what it
// returns is written back (nil: nothing).
func fakeServer(t *testing.T, respond func([]byte) []byte) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	go func() {
		for {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				buf := make([]byte, 4096)
				for {
					n, err := conn.Read(buf)
					if n > 0 {
						if answer := respond(append([]byte(nil), buf[:n]...)); answer != nil {
							_, _ = conn.Write(answer)
						}
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	return l.Addr().String()
}

// acquireFrames are the A frames in b (requests of the client).
func acquireFrames(b []byte) int {
	count := 0
	for i := 0; i < len(b); {
		switch b[i] {
		case 'A':
			count++
			i += 11
		case 'H', 'R':
			i += 9
		case 'P':
			i += 9
		default:
			i++
			continue
		}
		for i < len(b) && b[i] != '\n' {
			i++
		}
		i++
	}
	return count
}
