package testredis

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

const (
	// readyTimeout bounds how long a starting server may take to answer PING.
	readyTimeout = 10 * time.Second
	// pollInterval is the pause between two readiness probes.
	pollInterval = 5 * time.Millisecond
	// probeTimeout bounds one readiness probe (PING or INFO).
	probeTimeout = 100 * time.Millisecond
	// stopGrace is how long Stop waits after SIGTERM before SIGKILL.
	stopGrace = 3 * time.Second
	// startAttempts is how many times a start is tried when the port turned
	// out to be taken (another process bound it after we picked it).
	startAttempts = 5
	// logTailBytes is how much of the end of the log goes into an error.
	logTailBytes = 4 << 10
)

// errNotFound is returned by Start when redis-server is not on PATH. The
// message is meant to be read by whoever runs the tests.
var errNotFound = errors.New(`testredis: redis-server not found in PATH: install it with "apt-get install -y redis-server" (or run "make test", which installs it)`)

// errPortInUse marks a start that failed because the port was taken.
var errPortInUse = errors.New("address already in use")

// config collects what the Options set.
type config struct {
	args       []string
	ownSession bool
}

// Option configures a server started by Start, New or NewN.
type Option func(*config)

// WithArgs appends extra command-line arguments for redis-server, for
// example WithArgs("--maxclients", "100"). They come after the package's
// own flags, so they may override settings such as --save, but they must
// not change --port, --bind, --dir, --logfile or --daemonize, which the
// package relies on (--daemonize is always forced to no).
func WithArgs(args ...string) Option {
	return func(c *config) { c.args = append(c.args, args...) }
}

// WithOwnSession starts redis-server in a session of its own (setsid on Linux;
// nothing elsewhere). Where the kernel groups processes by session for CPU
// scheduling (Linux's autogroup, on by default in many distributions), a server
// in the starting process's session shares that session's one CPU share with
// it: under load its single thread then competes with the client's threads as
// one of them, where a Redis run as a service of its own has a share of its own.
// The benchmark harness starts its server so; tests do not need to. The server
// still dies with the process that started it, and Stop, Kill and Pause act on
// its PID as before.
func WithOwnSession() Option {
	return func(c *config) { c.ownSession = true }
}

// Server is one redis-server process owned by the test process. It listens
// on 127.0.0.1 on a port that stays the same for its whole life, including
// across Restart. All methods are safe for concurrent use.
type Server struct {
	port  int
	bin   string   // absolute path of redis-server
	dir   string   // temporary directory: working dir, --dir, log files
	extra []string // WithArgs arguments
	// ownSession: WithOwnSession.
	ownSession bool

	mu sync.Mutex
	// cmd is the running process, or nil when the server is killed or
	// stopped. A non-nil cmd has not been reaped yet.
	cmd *exec.Cmd
	// alive is the read end of a pipe whose only write end is held by the
	// process (as fd 3). Reading it returns io.EOF once the process has
	// exited, which lets the package wait for an exit with a timeout
	// without reaping the process or running a goroutine per server.
	alive *os.File
	// logOffset is the size of redis.log when the current process started,
	// so that errors quote only that process's lines.
	logOffset int64
	stopped   bool
}

// registry holds every server that has been started and not yet stopped.
var registry = struct {
	sync.Mutex
	servers map[*Server]struct{}
}{servers: make(map[*Server]struct{})}

// Start starts a redis-server on a free port of 127.0.0.1 and waits until
// it answers PING. The server keeps nothing on disk and runs until Stop (or
// StopAll). Start is for code that has no testing.TB, such as the benchmark
// command; tests use New.
func Start(opts ...Option) (*Server, error) {
	var cfg config
	for _, o := range opts {
		o(&cfg)
	}
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, errNotFound
	}
	if !filepath.IsAbs(bin) {
		if bin, err = filepath.Abs(bin); err != nil {
			return nil, fmt.Errorf("testredis: %w", err)
		}
	}
	dir, err := os.MkdirTemp("", "testredis-")
	if err != nil {
		return nil, fmt.Errorf("testredis: %w", err)
	}
	s := &Server{bin: bin, dir: dir, extra: cfg.args, ownSession: cfg.ownSession}

	s.mu.Lock()
	defer s.mu.Unlock()
	for attempt := 1; ; attempt++ {
		if s.port, err = freePort(); err != nil {
			break
		}
		err = s.launch()
		if err == nil {
			registry.Lock()
			registry.servers[s] = struct{}{}
			registry.Unlock()
			return s, nil
		}
		// Another process took the port between freePort and redis's own
		// bind: try again with a fresh port.
		if !errors.Is(err, errPortInUse) || attempt == startAttempts {
			break
		}
	}
	os.RemoveAll(dir)
	return nil, err
}

// New starts a server for the test (see Start) and stops it when the test
// and its subtests have finished. It calls t.Fatal if the server cannot be
// started, including when redis-server is not installed.
func New(t testing.TB, opts ...Option) *Server {
	t.Helper()
	s, err := Start(opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Stop(); err != nil {
			t.Errorf("testredis: stopping %s: %v", s.Addr(), err)
		}
	})
	return s
}

// NewN starts n independent standalone servers (not a cluster, not
// replicas), each on its own port, like n calls to New. It calls t.Fatal if
// any of them cannot be started.
func NewN(t testing.TB, n int, opts ...Option) []*Server {
	t.Helper()
	servers := make([]*Server, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { servers[i], errs[i] = Start(opts...) })
	}
	wg.Wait()
	for _, s := range servers {
		if s == nil {
			continue
		}
		t.Cleanup(func() {
			if err := s.Stop(); err != nil {
				t.Errorf("testredis: stopping %s: %v", s.Addr(), err)
			}
		})
	}
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	return servers
}

// Addr returns the server's address, "127.0.0.1:PORT".
func (s *Server) Addr() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
}

// Port returns the server's TCP port. It does not change across Restart.
func (s *Server) Port() int { return s.port }

// PID returns the process id of the running redis-server, or 0 when the
// server is killed or stopped. It changes after Restart.
func (s *Server) PID() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return 0
	}
	return s.cmd.Process.Pid
}

// Kill simulates a crash: it sends SIGKILL to the process and reaps it.
// Everything the server held in memory is lost and its port refuses
// connections until Restart. Killing a server that is not running (already
// killed, exited on its own, or stopped) is a no-op.
func (s *Server) Kill() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.killLocked()
	return nil
}

// Restart starts a new, empty redis-server on the same port with the same
// arguments and waits until it answers PING. A running (or paused) server is
// killed first, as by Kill. Restart fails if the server has been stopped.
func (s *Server) Restart() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return fmt.Errorf("testredis: restart %s: server was stopped", s.Addr())
	}
	s.killLocked()
	var err error
	for attempt := 1; attempt <= startAttempts; attempt++ {
		if err = s.launch(); err == nil || !errors.Is(err, errPortInUse) {
			return err
		}
		// The port can only be taken for a moment (another test's
		// redis-server probing it, a client's ephemeral port): back off a
		// little before trying the same port again.
		time.Sleep(time.Duration(attempt) * 50 * time.Millisecond)
	}
	return err
}

// Pause freezes the process with SIGSTOP: connections are still accepted by
// the kernel but no command is answered until Resume. It fails if the server
// is not running.
func (s *Server) Pause() error { return s.signal(syscall.SIGSTOP) }

// Resume continues a paused process with SIGCONT. It fails if the server is
// not running.
func (s *Server) Resume() error { return s.signal(syscall.SIGCONT) }

func (s *Server) signal(sig syscall.Signal) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return fmt.Errorf("testredis: signal %v to %s: server is not running", sig, s.Addr())
	}
	if err := s.cmd.Process.Signal(sig); err != nil {
		return fmt.Errorf("testredis: signal %v to %s: %w", sig, s.Addr(), err)
	}
	return nil
}

// Stop shuts the server down for good: SIGCONT (in case it is paused), then
// SIGTERM, then SIGKILL if it has not exited within about 3 seconds; it
// reaps the process and removes the server's temporary directory. Stop works
// whatever state the server is in (running, paused, killed, or exited on its
// own), is idempotent, and is safe to call concurrently.
func (s *Server) Stop() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return nil
	}
	s.stopped = true
	registry.Lock()
	delete(registry.servers, s)
	registry.Unlock()

	if s.cmd != nil {
		// Errors are ignored: the process may already have exited, in which
		// case the signals are pointless but harmless.
		p := s.cmd.Process
		_ = p.Signal(syscall.SIGCONT)
		_ = p.Signal(syscall.SIGTERM)
		if !s.exitedWithin(stopGrace) {
			_ = p.Kill()
		}
		_ = s.cmd.Wait() // the exit status is of no interest
		s.alive.Close()
		s.cmd, s.alive = nil, nil
	}
	if err := os.RemoveAll(s.dir); err != nil {
		return fmt.Errorf("testredis: stop %s: %w", s.Addr(), err)
	}
	return nil
}

// StopAll stops every server this package has started and not yet
// stopped, in parallel, and returns when they are all gone. Main calls it;
// programs that use Start call it before exiting.
func StopAll() {
	registry.Lock()
	servers := make([]*Server, 0, len(registry.servers))
	for s := range registry.servers {
		servers = append(servers, s)
	}
	registry.Unlock()

	var wg sync.WaitGroup
	for _, s := range servers {
		wg.Go(func() { _ = s.Stop() })
	}
	wg.Wait()
}

// Do sends one command over a fresh connection and returns the reply as
// text: simple strings, bulk strings and integers as their text, a nil reply
// as "", and an array as its elements rendered the same way and joined by
// "\n". An error reply is returned as an error whose message is the reply.
// The call gives up after 5 seconds. Do is meant for test assertions, not
// for exercising Redis.
func (s *Server) Do(args ...string) (string, error) {
	return s.DoContext(context.Background(), args...)
}

// DoContext is Do bounded by ctx: the call fails once ctx is done, with an
// error that wraps ctx's error. Without a deadline in ctx, the 5-second
// limit of Do applies.
func (s *Server) DoContext(ctx context.Context, args ...string) (string, error) {
	rep, err := roundTrip(ctx, s.Addr(), args)
	if err != nil {
		return "", fmt.Errorf("testredis: %s on %s: %w", commandName(args), s.Addr(), err)
	}
	if rep.kind == '-' {
		return "", redisError(rep.str)
	}
	return rep.text(), nil
}

// Info runs INFO section (plain INFO if section is "") and returns its
// fields as key -> value; section headers and blank lines are dropped.
func (s *Server) Info(section string) (map[string]string, error) {
	args := []string{"INFO"}
	if section != "" {
		args = append(args, section)
	}
	text, err := s.Do(args...)
	if err != nil {
		return nil, err
	}
	return parseInfo(text), nil
}

// CommandStats returns how many times each command has been called since
// the server started or since the last ResetStats, from INFO commandstats.
// Keys are lowercase command names such as "evalsha", "publish" or "ping";
// subcommands are reported the way Redis names them, e.g.
// "config|resetstat". Commands never called are absent.
func (s *Server) CommandStats() (map[string]int64, error) {
	info, err := s.Info("commandstats")
	if err != nil {
		return nil, err
	}
	return parseCommandStats(info)
}

// ResetStats runs CONFIG RESETSTAT, which zeroes the command statistics
// (and the other counters of INFO). Note that the CONFIG RESETSTAT call
// itself is then counted, as "config|resetstat".
func (s *Server) ResetStats() error {
	_, err := s.Do("CONFIG", "RESETSTAT")
	return err
}

// launch starts the process on s.port and waits until it answers PING. On
// failure the process is reaped and s.cmd is nil. The caller holds s.mu (or
// owns s exclusively).
func (s *Server) launch() error {
	logPath := filepath.Join(s.dir, "redis.log")
	s.logOffset = 0
	if fi, err := os.Stat(logPath); err == nil {
		s.logOffset = fi.Size()
	}
	// Anything redis-server prints on stdout or stderr (configuration
	// errors are printed there, before the log file is open) goes to a
	// file, so no goroutine has to copy it.
	out, err := os.OpenFile(filepath.Join(s.dir, "redis.out"), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("testredis: %w", err)
	}
	defer out.Close()
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("testredis: %w", err)
	}
	defer w.Close()

	cmd := exec.Command(s.bin, s.argv()...)
	cmd.Dir = s.dir
	cmd.Stdout = out
	cmd.Stderr = out
	cmd.ExtraFiles = []*os.File{w}
	cmd.SysProcAttr = childAttrs(s.ownSession)
	if err := cmd.Start(); err != nil {
		r.Close()
		return fmt.Errorf("testredis: start redis-server: %w", err)
	}
	// From here on only the child holds the write end.
	w.Close()
	s.cmd, s.alive = cmd, r

	if err := s.waitReady(); err != nil {
		s.killLocked()
		return err
	}
	return nil
}

// argv returns redis-server's arguments.
func (s *Server) argv() []string {
	args := []string{
		"--port", strconv.Itoa(s.port),
		"--bind", "127.0.0.1",
		"--save", "",
		"--appendonly", "no",
		"--dir", s.dir,
		"--logfile", filepath.Join(s.dir, "redis.log"),
		"--protected-mode", "no",
	}
	args = append(args, s.extra...)
	return append(args, "--daemonize", "no")
}

// waitReady polls the server with PING until it answers, the process
// exits, or readyTimeout passes. To be sure the answer comes from this
// process and not from another server that grabbed the port, it then
// checks the process id reported by INFO server.
func (s *Server) waitReady() error {
	deadline := time.Now().Add(readyTimeout)
	pid := s.cmd.Process.Pid
	for {
		// Check for an early exit first: when the port is taken, the
		// process exits within a millisecond or two, while a probe of
		// whatever holds the port could hang until probeTimeout.
		if s.exitedWithin(pollInterval) {
			waitErr := s.cmd.Wait()
			s.alive.Close()
			s.cmd, s.alive = nil, nil
			tail := s.logTail()
			err := fmt.Errorf("testredis: redis-server on %s exited before answering PING (%v)%s", s.Addr(), waitErr, tail)
			if strings.Contains(tail, "Address already in use") {
				err = fmt.Errorf("%w: %w", errPortInUse, err)
			}
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
		rep, err := roundTrip(ctx, s.Addr(), []string{"PING"})
		if err == nil && rep.kind == '+' && rep.str == "PONG" {
			rep, err = roundTrip(ctx, s.Addr(), []string{"INFO", "server"})
			if err == nil && rep.kind == '$' && parseInfo(rep.str)["process_id"] == strconv.Itoa(pid) {
				cancel()
				return nil
			}
		}
		cancel()

		if time.Now().After(deadline) {
			s.killLocked()
			return fmt.Errorf("testredis: redis-server on %s did not answer PING within %v%s", s.Addr(), readyTimeout, s.logTail())
		}
	}
}

// exitedWithin reports whether the process exits within d. It does not
// reap the process.
func (s *Server) exitedWithin(d time.Duration) bool {
	if err := s.alive.SetReadDeadline(time.Now().Add(d)); err != nil {
		return false
	}
	var buf [64]byte
	for {
		_, err := s.alive.Read(buf[:])
		if err == io.EOF {
			return true
		}
		if err != nil {
			return false
		}
		// Nothing writes to the pipe; ignore stray bytes and read on.
	}
}

// killLocked kills and reaps the running process, if any. The caller holds
// s.mu.
func (s *Server) killLocked() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill() // fails only if the process has exited already
	_ = s.cmd.Wait()         // a "signal: killed" exit status is expected
	s.alive.Close()
	s.cmd, s.alive = nil, nil
}

// logTail returns the end of what the current process wrote to its log and
// to stdout/stderr, formatted to be appended to an error message.
func (s *Server) logTail() string {
	var b strings.Builder
	for _, f := range []struct {
		name   string
		offset int64
	}{
		{"redis.out", 0},
		{"redis.log", s.logOffset},
	} {
		path := filepath.Join(s.dir, f.name)
		text := readTail(path, f.offset, logTailBytes)
		if strings.TrimSpace(text) == "" {
			continue
		}
		fmt.Fprintf(&b, "\n--- %s ---\n%s", path, strings.TrimRight(text, "\n"))
	}
	if b.Len() == 0 {
		return "; the redis log is empty"
	}
	return b.String()
}

// readTail returns at most n bytes from the end of the file, not reading
// before offset. Errors yield "".
func readTail(path string, offset, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return ""
	}
	start := max(offset, fi.Size()-n, 0)
	if _, err := f.Seek(start, io.SeekStart); err != nil {
		return ""
	}
	data, err := io.ReadAll(io.LimitReader(f, n))
	if err != nil {
		return ""
	}
	return string(data)
}

// freePort returns a port of 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("testredis: find a free port: %w", err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	if err := l.Close(); err != nil {
		return 0, fmt.Errorf("testredis: find a free port: %w", err)
	}
	return port, nil
}

// parseInfo parses the text of an INFO reply.
func parseInfo(text string) map[string]string {
	m := make(map[string]string)
	for line := range strings.Lines(text) {
		line = strings.TrimRight(line, "\r\n")
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if k, v, ok := strings.Cut(line, ":"); ok {
			m[k] = v
		}
	}
	return m
}

// parseCommandStats extracts the calls counts from INFO commandstats fields
// of the form cmdstat_NAME:calls=N,usec=...
func parseCommandStats(info map[string]string) (map[string]int64, error) {
	stats := make(map[string]int64)
	for k, v := range info {
		name, ok := strings.CutPrefix(k, "cmdstat_")
		if !ok {
			continue
		}
		found := false
		for field := range strings.SplitSeq(v, ",") {
			if n, ok := strings.CutPrefix(field, "calls="); ok {
				calls, err := strconv.ParseInt(n, 10, 64)
				if err != nil {
					return nil, fmt.Errorf("testredis: commandstats %s: bad calls %q", name, n)
				}
				stats[strings.ToLower(name)] = calls
				found = true
				break
			}
		}
		if !found {
			return nil, fmt.Errorf("testredis: commandstats %s: no calls field in %q", name, v)
		}
	}
	return stats, nil
}

// commandName names a command in error messages.
func commandName(args []string) string {
	if len(args) == 0 {
		return "(empty command)"
	}
	return strings.ToUpper(args[0])
}
