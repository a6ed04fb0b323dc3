/* One ggml-bank MoE call (moed_cpu_ggml_moe) driven from C: 8 experts per call cycling through a 512 MiB
 * bank of one type, the rows as stored and interleaved in eights (x8) alternating. Not part of CI; the
 * figure to compare with `moed bench kernels`, which drives the same call from Python.
 *
 *   gcc -O3 -std=gnu11 -pthread -Inative/cpu -o /tmp/ggml_moe_call benchmarks/ggml_moe_call.c native/cpu/[a-z]*.c -lm
 *   /tmp/ggml_moe_call TYPE_ID [SPIN_NS 30000]      # e.g. 12 (Q4_K)
 *
 * Random bytes stand in for the blocks (denormals flushed): only the time is read. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "ggml_rows.h"
#include "ggml_x8.h"
#include "moed_api.h"
#include "moed_cpu.h"
void *moed_cpu_create(int nthreads, int64_t spin_ns);
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  _mm_setcsr(_mm_getcsr()|0x8040);
  if(argc<2){fprintf(stderr,"usage: %s TYPE_ID [SPIN_NS]\n",argv[0]);return 2;}
  int type=atoi(argv[1]); int64_t D=2048,I=768; int64_t spin=argc>2?atoll(argv[2]):30000;
  if(!moed_ggml_x8_of(type)){fprintf(stderr,"type %d has no x8 layout\n",type);return 1;}
  int bw=moed_ggml_block_weights(type), bb=moed_ggml_block_bytes(type);
  int64_t rbD=D/bw*bb, rbI=I/bw*bb; int64_t per=2*I*rbD+D*rbI; int64_t E=(512LL<<20)/per/8*8;
  uint8_t *g=malloc(E*I*rbD),*u=malloc(E*I*rbD),*d=malloc(E*D*rbI);
  uint8_t *gx=malloc(E*I*rbD),*ux=malloc(E*I*rbD),*dx=malloc(E*D*rbI);
  for(int64_t i=0;i<E*I*rbD;i++){g[i]=rand();u[i]=rand();} for(int64_t i=0;i<E*D*rbI;i++) d[i]=rand();
  moed_ggml_x8_pack(type,g,E*I,D,gx); moed_ggml_x8_pack(type,u,E*I,D,ux); moed_ggml_x8_pack(type,d,E*D,I,dx);
  void *h=moed_cpu_create(2,spin);
  float x[2048]; for(int i=0;i<D;i++) x[i]=(rand()%2001-1000)/1000.0f;
  float wts[8]={.125,.125,.125,.125,.125,.125,.125,.125}, y[2048]; int32_t ids[8];
  for(int rep=0;rep<6;rep++){
    int xm = rep&1;
    moed_ggml_layer L={{xm?gx:g,xm?moed_ggml_x8_of(type):type,I,D,rbD},{xm?ux:u,xm?moed_ggml_x8_of(type):type,I,D,rbD},{xm?dx:d,xm?moed_ggml_x8_of(type):type,D,I,rbI},E,0,0,0,0,0,0,0,0};
    double best=1e9;
    for(int tr=0;tr<5;tr++){
      double t0=now();
      for(int64_t e=0;e+8<=E;e+=8){ for(int a=0;a<8;a++) ids[a]=e+a; int rc=moed_cpu_ggml_moe(h,&L,x,1,8,ids,wts,NULL,y); if(rc){printf("rc %d\n",rc);return 1;} }
      double t=now()-t0; if(t<best) best=t;
    }
    printf("%s: %.1f us/expert, %.1f GB/s\n", xm?"x8  ":"rows", best/(E/8*8)*1e6, (double)per*(E/8*8)/best/1e9);
  }
}
