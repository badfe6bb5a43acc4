package testredis

import (
	"os"
	"strconv"
	"strings"
	"testing"
)

// sessionOf reads a process's session id from /proc/<pid>/stat (the sixth
// field; the second, the command name in parentheses, may hold spaces).
func sessionOf(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	sid, err := strconv.Atoi(fields[3]) // state, ppid, pgrp, session
	if err != nil {
		t.Fatalf("stat %q: %v", s, err)
	}
	return sid
}

// WithOwnSession puts the server in a session of its own (its session id is
// its PID); without it the server stays in the test's session. Either way it
// answers (and the cleanup's Stop, by PID, ends it).
func TestWithOwnSession(t *testing.T) {
	mine := sessionOf(t, os.Getpid())
	own := New(t, WithOwnSession())
	if got := sessionOf(t, own.PID()); got != own.PID() {
		t.Errorf("WithOwnSession: server %d is in session %d, want its own", own.PID(), got)
	}
	shared := New(t)
	if got := sessionOf(t, shared.PID()); got != mine {
		t.Errorf("default: server %d is in session %d, want the test's %d", shared.PID(), got, mine)
	}
	for _, s := range []*Server{own, shared} {
		if got, err := s.Do("PING"); err != nil || got != "PONG" {
			t.Errorf("PING: %q, %v", got, err)
		}
	}
}
